"""Block-scaled FP8 weights: the `rtts quantize` format and the modules that run it.

On disk (`rtts quantize SRC DST`): every transformer linear of the slow and fast stacks (`attention.wqkv`,
`attention.wo`, `feed_forward.w1/w3/w2`) stores `<name>.weight` as float8_e4m3fn [N, K] and `<name>.weight_scale` as
float32 [ceil(N/128), ceil(K/128)] — one dequantization multiplier per 128x128 block, row-major, exactly what the
GEMM kernel reads. Embeddings, norms and the output heads stay in the checkpoint's dtype. `config.json` gains
`"quantization": {"method": "fp8_block", "block": [128, 128]}`.

At run time the MLP fuses w1 and w3 into one [2I, K] weight (the 128-row blocks line up when I % 128 == 0), so one
GEMM produces [gate | up] and the fused SwiGLU-quantize kernel feeds the down projection. On GPUs that run the wgmma
GEMM (sm_90a) every FP8 weight is then repacked once into the tile layout that kernel streams
(`kernels.pack_weight`: [N/128, K/128, 128, 128], same bytes, reordered); the file keeps [N, K].
"""

from __future__ import annotations

import re

import torch
from torch import nn

from rtts import kernels
from rtts.kernels import reference
from rtts.kernels.norm_rope import QuantizedRows
from rtts.model.layers import FeedForward

QUANT_CONFIG = {"method": "fp8_block", "block": [128, 128]}
_QUANTIZED = re.compile(r"(^|\.)(fast_)?layers\.\d+\.(attention\.(wqkv|wo)|feed_forward\.(w1|w2|w3))\.weight$")


def is_quantized_name(name: str) -> bool:
    """Internal parameter names that `rtts quantize` stores in FP8."""
    return bool(_QUANTIZED.search(name))


class FP8Linear(nn.Module):
    """y = x @ dequant(weight)^T with bf16 in/out (no bias: the DualAR linears have none)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=reference.FP8), requires_grad=False)
        self.weight_scale = nn.Parameter(
            torch.empty(-(-out_features // 128), -(-in_features // 128), dtype=torch.float32), requires_grad=False
        )

    takes_quantized = True  # forward() also takes the norm kernels' quantized rows (norm_rope.QuantizedRows)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            y = kernels.fp8_gemm(x.q, x.scale, self.weight, self.weight_scale)
            return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)
        if kernels.fp8_runs_dense(x):  # prefill: one dense GEMM on the dequantized weight
            return nn.functional.linear(x.to(torch.bfloat16), self.dense_weight()).to(x.dtype)
        return kernels.fp8_linear(x.to(torch.bfloat16), self.weight, self.weight_scale).to(x.dtype)

    def dense_weight(self) -> torch.Tensor:
        """The weight dequantized to bf16 [N, K] (a fresh buffer per call: prefill only, never kept)."""
        return kernels.dequantize_weight(self.weight, self.weight_scale)

    def pack(self) -> None:
        """Put the weight in the layout this device's GEMM streams (once, after loading; kernels.prepare_weight)."""
        w = self.weight.data
        p = kernels.prepare_weight(w)
        if p is not w:
            self.weight = nn.Parameter(p, requires_grad=False)


class FP8FeedForward(nn.Module):
    """SwiGLU MLP on FP8 weights: fused gate/up GEMM -> SwiGLU + 1x128 quantize -> down GEMM."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = FP8Linear(dim, hidden), FP8Linear(dim, hidden), FP8Linear(hidden, dim)
        self.gate_up: torch.Tensor | None = None  # [2I, K] fp8, built by fuse()
        self.gate_up_scale: torch.Tensor | None = None

    def fuse(self) -> None:
        """Concatenate w1 and w3 (and their block scales) into one weight, packed where the device runs the wgmma
        GEMM; w1/w3 become views into it (a packed weight's leading axis is 128-row tiles, so they stay packed)."""
        hidden = self.w1.out_features
        if hidden % 128:  # block rows would straddle the seam: keep two GEMMs
            return
        gate_up = kernels.prepare_weight(torch.cat([self.w1.weight.data, self.w3.weight.data]))
        if gate_up.dim() == 4:  # packed: the leading axis counts 128-row tiles
            hidden //= 128
        self.gate_up = gate_up
        self.gate_up_scale = torch.cat([self.w1.weight_scale.data, self.w3.weight_scale.data])
        self.w1.weight.data, self.w3.weight.data = self.gate_up[:hidden], self.gate_up[hidden:]

    takes_quantized = True  # forward() also takes the norm kernels' quantized rows (norm_rope.QuantizedRows)

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        lead = x.shape[:-1]
        if not isinstance(x, QuantizedRows) and kernels.fp8_runs_dense(x):
            return self._dense(x)
        if isinstance(x, QuantizedRows):
            x2: torch.Tensor | QuantizedRows = QuantizedRows(x.q, x.scale, x.q.shape, torch.bfloat16)
        else:
            x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        if self.gate_up is None or self.gate_up_scale is None:
            h = nn.functional.silu(self.w1(x2)) * self.w3(x2)
            return self.w2(h).view(*lead, -1).to(x.dtype)
        xq, sx = (x2.q, x2.scale) if isinstance(x2, QuantizedRows) else kernels.quantize_1x128(x2)
        gu = kernels.fp8_gemm(xq, sx, self.gate_up, self.gate_up_scale)  # [M, 2I]
        hq, sh = kernels.swiglu_quantize(gu)
        y = kernels.fp8_gemm(hq, sh, self.w2.weight, self.w2.weight_scale)
        return y.view(*lead, -1).to(x.dtype)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        """Prefill (kernels.fp8_runs_dense): the weights dequantized to bf16, dense GEMMs, SwiGLU in
        bf16 (no activation quantization: the rows never meet an FP8 GEMM)."""
        xb, linear = x.to(torch.bfloat16), nn.functional.linear
        if self.gate_up is not None and self.gate_up_scale is not None:
            gate, up = linear(xb, kernels.dequantize_weight(self.gate_up, self.gate_up_scale)).chunk(2, -1)
        else:
            gate, up = linear(xb, self.w1.dense_weight()), linear(xb, self.w3.dense_weight())
        return linear(nn.functional.silu(gate) * up, self.w2.dense_weight()).to(x.dtype)


def _fp8_targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every transformer MLP and attention projection stored in FP8."""
    out = []
    for name, mod in list(model.named_modules()):
        for child_name, child in mod.named_children():
            full = f"{name}.{child_name}" if name else child_name
            mlp = isinstance(child, FeedForward) and re.search(r"layers\.\d+\.feed_forward$", full)
            proj = isinstance(child, nn.Linear) and re.search(r"layers\.\d+\.attention\.(wqkv|wo)$", full)
            if mlp or proj:
                if isinstance(child, nn.Linear) and child.bias is not None:
                    raise ValueError(f"{full}: FP8 linears have no bias")
                out.append((mod, child_name, child))
    return out


def _fp8_module(child: nn.Module) -> nn.Module:
    """The empty FP8 counterpart of a bf16 MLP or projection."""
    if isinstance(child, FeedForward):
        return FP8FeedForward(child.w1.in_features, child.w1.out_features)
    assert isinstance(child, nn.Linear)
    return FP8Linear(child.in_features, child.out_features)


def convert_to_fp8(model: nn.Module) -> None:
    """Swap the quantizable linears of a (meta-device) model for FP8 modules, in place."""
    for parent, attr, child in _fp8_targets(model):
        with torch.device("meta"):
            setattr(parent, attr, _fp8_module(child))


def finish_fp8(model: nn.Module) -> None:
    """After loading or quantizing: fuse each MLP's gate/up and put every FP8 weight in the layout the device's GEMM
    streams."""
    for m in list(model.modules()):
        if isinstance(m, FP8FeedForward):
            m.fuse()
        elif isinstance(m, FP8Linear):  # after its MLP (modules() is pre-order): w1/w3 are already views of gate|up
            m.pack()


def require_blocks(name: str, n: int, k: int) -> None:
    if n % 128 or k % 128:
        raise ValueError(f"{name}: shape [{n}, {k}] is not a multiple of the 128x128 FP8 block")


def quantize_model_(model: nn.Module) -> None:
    """Quantize a loaded bf16/fp32 model's transformer linears in place (same result as `rtts quantize` + load)."""
    targets = _fp8_targets(model)
    for _, _, child in targets:  # check every shape before changing anything
        for lin in (child.w1, child.w3, child.w2) if isinstance(child, FeedForward) else (child,):
            assert isinstance(lin, nn.Linear)
            require_blocks(type(child).__name__, lin.out_features, lin.in_features)
    for parent, attr, child in targets:
        fp8 = _fp8_module(child)
        if isinstance(fp8, FP8FeedForward):
            assert isinstance(child, FeedForward)
            for src, dst in ((child.w1, fp8.w1), (child.w3, fp8.w3), (child.w2, fp8.w2)):
                _fill(dst, src.weight.data)
        else:
            assert isinstance(fp8, FP8Linear) and isinstance(child, nn.Linear)
            _fill(fp8, child.weight.data)
        setattr(parent, attr, fp8)
    finish_fp8(model)


def _fill(lin: FP8Linear, w: torch.Tensor) -> None:
    q, s = reference.quantize_weight(w)
    lin.weight = nn.Parameter(q, requires_grad=False)
    lin.weight_scale = nn.Parameter(s.contiguous(), requires_grad=False)
