"""FP8 quantization on the GPU (cuda/fp8_quant.cu, cuda/dequant.cu): activations 1x128 for the FP8 GEMM, SwiGLU fused
with that quantization, and 128x128-block weights back to bf16 (the prefill's dense path)."""

from __future__ import annotations

import math

import torch

from rtts.kernels import _jit, reference
from rtts.kernels.common import check, i32, use_cuda
from rtts.kernels.reference import FP8, pad4

_DEQUANT_INSTANCES = ("dequantize_fp8<true>", "dequantize_fp8<false>")


def quantize_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x bf16 [M, K] (row-contiguous, K % 128 == 0) -> (q fp8 [M, K], scale fp32 [K/128, pad4(M)])."""
    check(x.dim() == 2 and x.dtype == torch.bfloat16,
          lambda: f"quantize_1x128: want bf16 [M, K], got {x.dtype} {tuple(x.shape)}")
    M, K = x.shape
    check(K % 128 == 0 and x.stride(1) == 1,
          lambda: f"quantize_1x128: K={K} must be a multiple of 128 with unit stride")
    if not use_cuda(x):
        return reference.quantize_1x128(x)
    check(x.stride(0) % 4 == 0 and x.data_ptr() % 8 == 0,
          "quantize_1x128: rows must start 8-byte aligned (the kernel reads 4 bf16 per load)")
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    s = torch.empty(K // 128, pad4(M), dtype=torch.float32, device=x.device)  # the kernel writes the padding too
    if M == 0:
        return q, s
    warps = M * (K // 128)
    fn = _jit.function("fp8_quant.cu", "quantize_1x128")
    _jit.launch(fn, (math.ceil(warps / 8),), (256,),
                (x.data_ptr(), i32(x.stride(0)), q.data_ptr(), s.data_ptr(), i32(M), i32(K), i32(pad4(M))), pdl=True)
    return q, s


def swiglu_quantize(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up bf16 [M, 2I] = [gate | up] (contiguous, I % 128 == 0) -> quantized silu(gate) * up, as quantize_1x128."""
    check(gate_up.dim() == 2 and gate_up.dtype == torch.bfloat16 and gate_up.is_contiguous(),
          lambda: f"swiglu_quantize: want contiguous bf16 [M, 2I], got {gate_up.dtype} {tuple(gate_up.shape)}")
    M, I2 = gate_up.shape
    check(I2 % 256 == 0, lambda: f"swiglu_quantize: 2I={I2} must be a multiple of 256")
    if not use_cuda(gate_up):
        return reference.swiglu_quantize(gate_up)
    check(gate_up.data_ptr() % 8 == 0, "swiglu_quantize: gate_up must start 8-byte aligned (4 bf16 per load)")
    I = I2 // 2  # noqa: E741
    q = torch.empty(M, I, dtype=FP8, device=gate_up.device)
    s = torch.empty(I // 128, pad4(M), dtype=torch.float32, device=gate_up.device)  # padding written by the kernel
    if M == 0:
        return q, s
    warps = M * (I // 128)
    fn = _jit.function("fp8_quant.cu", "swiglu_quantize_1x128")
    _jit.launch(fn, (math.ceil(warps / 8),), (256,),
                (gate_up.data_ptr(), q.data_ptr(), s.data_ptr(), i32(M), i32(I), i32(pad4(M))), pdl=True)
    return q, s


def dequantize_weight(wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """wq fp8 [N, K] or packed [N/128, K/128, 128, 128] (pack_weight), sw fp32 [ceil(N/128), ceil(K/128)] ->
    bf16 [N, K] = wq * sw per 128x128 block (cuda/dequant.cu)."""
    check(wq.dtype == FP8 and wq.dim() in (2, 4) and wq.is_contiguous(),
          lambda: f"dequantize_weight: want a contiguous float8_e4m3fn [N, K] or packed weight, got {wq.dtype} "
                  f"{tuple(wq.shape)}")
    packed = wq.dim() == 4
    if packed:
        check(tuple(wq.shape[2:]) == (128, 128),
              lambda: f"dequantize_weight: packed blocks must be 128x128, got {tuple(wq.shape)}")
        N, K = wq.shape[0] * 128, wq.shape[1] * 128
    else:
        N, K = wq.shape
        check(K % 16 == 0, lambda: f"dequantize_weight: K={K} must be a multiple of 16")
    check(sw.dtype == torch.float32 and tuple(sw.shape) == (math.ceil(N / 128), math.ceil(K / 128))
          and sw.is_contiguous(),
          lambda: f"dequantize_weight: sw must be contiguous fp32 [{math.ceil(N / 128)}, {math.ceil(K / 128)}], got "
                  f"{sw.dtype} {tuple(sw.shape)}")
    if not use_cuda(wq, sw):
        return reference.dequantize_bf16(wq, sw)
    y = torch.empty(N, K, dtype=torch.bfloat16, device=wq.device)
    chunks = N * K // 16
    if chunks == 0:
        return y
    fn = _jit.function("dequant.cu", f"dequantize_fp8<{'true' if packed else 'false'}>", _DEQUANT_INSTANCES)
    _jit.launch(fn, (math.ceil(chunks / 256),), (256,), (wq.data_ptr(), sw.data_ptr(), y.data_ptr(), i32(N), i32(K)))
    return y


def warmup() -> None:
    _jit.function("fp8_quant.cu", "quantize_1x128")
    _jit.function("fp8_quant.cu", "swiglu_quantize_1x128")
    for inst in _DEQUANT_INSTANCES:
        _jit.function("dequant.cu", inst, _DEQUANT_INSTANCES)
