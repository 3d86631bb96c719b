"""The codec's convolutions and Snake: causal (transposed) convs, the residual unit, and how they stream.

Every module on the decode path has two entry points:
- `forward(x)`: a whole sequence from time 0 (zero left context), as the reference decodes.
- `step(x, tails)`: the next chunk of a stream. `tails` is a per-call list of context tensors (the last
  input samples each causal conv has seen), indexed by the conv's `tail_id`; `step` reads its entry and
  replaces it with the new context. `codec_stream.py` gathers/scatters these lists from the per-slot state.
Both paths run the same convolutions on the same input samples, so a stream equals the whole decode up to
float rounding of differently-shaped kernels.

On a GPU, at inference, two rewrites keep the same math and cut passes over memory (bench/results/PERF.md):
in half precision a dilated conv runs as an undilated one over its `dilation` interleaved phases (cuDNN's kernel
choice for some dilated shapes runs without tensor cores, at ~12x the time of the same shape undilated), and a
residual unit runs its convs without their biases, which the next Snake kernel and the closing residual kernel add in
their single passes (torch adds a cuDNN conv's bias as a broadcast pass of its own). With both, a unit's Snakes write
and read its k7 conv's input and output in phase layout, channels last, in place (`ResidualUnit._through_phases`): the
conv's context, padding, phase permutes and cuDNN's layout transposes cost no passes of their own.
`RTTS_CODEC_POLYPHASE=0` / `RTTS_CODEC_FUSED=0` / `RTTS_CODEC_CHANNELS_LAST=0` turn them off for comparison.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from rtts import env, kernels
from rtts.kernels import reference

# Per-call conv contexts, one entry per stateful conv of the decode path (see `tail_id`).
Tails = list[torch.Tensor]
# Where running dilated convs by phases was measured faster (bench/results/PERF.md); in strict float32 cuDNN's
# kernels for the phase shapes were 7x slower at 64 streams.
_PHASED_DTYPES = (torch.float16, torch.bfloat16)


def conv1d_by_phases(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int) -> torch.Tensor:
    """F.conv1d(x, weight, bias, dilation=dilation) (stride 1, no padding, one group) computed as an undilated conv
    over the `dilation` phases of x: output t = p + d*j reads inputs p + d*(j + k), i.e. phase p's samples j + k.
    x [B, C, L] -> [B, O, L - (K - 1) * dilation]; the same products and sums, so the same values up to the
    reduction order of the kernel cuDNN picks."""
    B, C, L = x.shape
    K, d = weight.shape[-1], dilation
    out_len = L - (K - 1) * d
    J = -(-L // d)  # samples per phase, x padded on the right to J * d (the padding reaches only cut outputs)
    while (J - K + 1) * d % 4:  # rows of the result 4-aligned: the Snake kernel after reads them 4 at a time
        J += 1
    if J * d != L:
        x = F.pad(x, (0, J * d - L))
    phases = x.view(B, C, J, d).permute(0, 3, 1, 2).reshape(B * d, C, J)
    y = F.conv1d(phases, weight, bias)  # [B*d, O, J - K + 1]
    y = y.view(B, d, -1, J - K + 1).permute(0, 2, 3, 1).reshape(B, -1, (J - K + 1) * d)
    return y[..., :out_len]


def _inference(x: torch.Tensor, *modules: nn.Module) -> bool:
    """No gradient is wanted through x or these modules' weights (the kernels have no backward)."""
    if not torch.is_grad_enabled():
        return True
    return not x.requires_grad and not any(p.requires_grad for m in modules for p in m.parameters())


class CausalConv1d(nn.Module):
    """Conv1d with causal padding: `(k-1)*d + 1 - stride` zeros on the left, and on the right only what
    completes the last stride (docs/architecture.md: causal padding), so the output has `ceil(L / stride)` steps.

    `weight_norm` records how the release file spells this conv's weight (parametrized g/v or plain).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        groups: int = 1,
        weight_norm: bool = True,
    ) -> None:
        super().__init__()
        self.conv = nn.Conv1d(
            in_channels, out_channels, kernel_size, stride=stride, dilation=dilation, groups=groups
        )
        self.stride = stride
        self.context = (kernel_size - 1) * dilation + 1 - stride
        self.weight_norm = weight_norm
        self.tail_id = -1  # set by the codec for convs on the streamed decode path
        self._cl_weight: tuple[tuple[int, int, torch.dtype, torch.device], torch.Tensor] | None = None

    def channels_last_weight(self) -> torch.Tensor:
        """The weight as a channels-last [out, in, 1, K] tensor for the phased conv, made once per weight version
        (a copy per call would be one more kernel in every captured decode)."""
        w = self.conv.weight
        key = (w.data_ptr(), w._version, w.dtype, w.device)
        if self._cl_weight is None or self._cl_weight[0] != key:
            self._cl_weight = key, w.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)
        return self._cl_weight[1]

    def run(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        """The conv over x as given (its context already in front); `bias=False` leaves the bias to the caller."""
        c = self.conv
        b = c.bias if bias else None
        if (c.dilation[0] > 1 and c.groups == 1 and self.stride == 1 and x.is_cuda and x.dtype in _PHASED_DTYPES
                and env.kernel_switches().codec_polyphase):
            return conv1d_by_phases(x, c.weight, b, c.dilation[0])
        return F.conv1d(x, c.weight, b, c.stride, 0, c.dilation, c.groups)

    def forward(self, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        # x: [B, C_in, L] -> [B, C_out, ceil(L / stride)]
        extra = (-x.shape[-1]) % self.stride
        return self.run(F.pad(x, (self.context, extra)), bias)

    def step(self, x: torch.Tensor, tails: Tails, bias: bool = True) -> torch.Tensor:
        # x: [B, C_in, t] -> [B, C_out, t]; tails[tail_id]: [B, C_in, context] (stride 1 only)
        if self.context == 0:
            return self.run(x, bias)
        xx = torch.cat([tails[self.tail_id], x], dim=-1)
        tails[self.tail_id] = xx[..., xx.shape[-1] - self.context :]
        return self.run(xx, bias)


class CausalConvTranspose1d(nn.Module):
    """ConvTranspose1d whose output is trimmed by `k - stride` samples on the right (docs/architecture.md):
    L input steps -> L * stride output samples, each output block depending on its own input step and the
    `context` previous ones (k = 2s: one previous step).

    Streaming keeps the previous input steps (not the overlapping output) and re-runs the transposed conv
    over [previous, new]: the overlap-add then happens inside the same kernel with the same operands as in
    the whole decode, which keeps the stream within float rounding of it.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, stride: int, weight_norm: bool = True
    ) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(in_channels, out_channels, kernel_size, stride=stride)
        self.stride = stride
        self.trim = kernel_size - stride
        self.context = math.ceil(self.trim / stride)  # previous input steps that overlap the next block
        self.weight_norm = weight_norm
        self.tail_id = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, C_in, L] -> [B, C_out, L * stride]
        y = self.conv(x)
        return y[..., : y.shape[-1] - self.trim]

    def step(self, x: torch.Tensor, tails: Tails) -> torch.Tensor:
        # x: [B, C_in, t] -> [B, C_out, t * stride] (a slice along t: the codec kernels read it in place);
        # tails[tail_id]: [B, C_in, context]
        if self.context == 0:
            return self.forward(x)
        xx = torch.cat([tails[self.tail_id], x], dim=-1)
        tails[self.tail_id] = xx[..., xx.shape[-1] - self.context :]
        start = self.context * self.stride
        return self.conv(xx)[..., start : start + x.shape[-1] * self.stride]


class Snake1d(nn.Module):
    """Snake activation `x + sin(alpha x)^2 / (alpha + 1e-9)`, alpha per channel."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, C, L]. Inference on a GPU takes the one-pass kernel (torch's five elementwise passes were ~40% of a
        # streaming chunk decode); with autograd on, the torch expression, which it can differentiate.
        if kernels.fits_kernels(x) and _inference(x, self):
            return kernels.snake(x, self.alpha)
        return reference.snake(x, self.alpha.view(-1))


def step_sequence(modules: nn.Sequential, x: torch.Tensor, tails: Tails) -> torch.Tensor:
    """Run the streaming `step` of every module of a Sequential (stateless ones just run forward)."""
    for module in modules:
        if isinstance(module, nn.Sequential):
            x = step_sequence(module, x, tails)
        else:
            step = getattr(module, "step", None)  # stateless modules (Snake, Tanh) have none
            x = module(x) if step is None else step(x, tails)
    return x


class ResidualUnit(nn.Module):
    """Snake -> causal conv k7 (dilation d) -> Snake -> conv k1, plus the input."""

    def __init__(self, dim: int, dilation: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            Snake1d(dim),
            CausalConv1d(dim, dim, 7, dilation=dilation),
            Snake1d(dim),
            CausalConv1d(dim, dim, 1),
        )

    def _parts(self) -> tuple[Snake1d, CausalConv1d, Snake1d, CausalConv1d]:
        snake1, conv7, snake2, conv1 = self.block
        assert isinstance(snake1, Snake1d) and isinstance(snake2, Snake1d)
        assert isinstance(conv7, CausalConv1d) and isinstance(conv1, CausalConv1d)
        return snake1, conv7, snake2, conv1

    def _fused(self, x: torch.Tensor) -> bool:
        return (x.is_cuda and kernels.fits_kernels(x) and env.kernel_switches().codec_fused
                and _inference(x, self))

    def _phased(self, x: torch.Tensor) -> bool:
        switches = env.kernel_switches()
        return x.dtype in _PHASED_DTYPES and switches.codec_polyphase and switches.codec_channels_last

    def _through_phases(self, x: torch.Tensor, tails: Tails | None) -> torch.Tensor:
        # `_biases_in_kernels` with the k7 conv (dilation d, 1 included) over d phases, channels last, that the Snakes
        # write and read in place: no concatenation with the context, no padding, no permutes and none of cuDNN's
        # NCHW <-> NHWC transposes (each a full pass over the activations).
        snake1, conv7, snake2, conv1 = self._parts()
        B, C, L = x.shape
        d, ctx = conv7.conv.dilation[0], conv7.context  # ctx = (K - 1) * d: whole phase columns
        K = conv7.conv.kernel_size[0]
        J = -(-(ctx + L) // d)
        phases = x.new_empty(B * d, J, C)
        by_phase = phases.view(B, d, J, C)
        if (ctx + L) % d:  # padding past the last position: it reaches only cut outputs, but must not be NaN
            by_phase[:, :, J - 1].zero_()
        if tails is None:  # the whole sequence: zeros before it
            by_phase[:, :, : ctx // d].zero_()
        else:
            by_phase[:, :, : ctx // d] = tails[conv7.tail_id].reshape(B, C, ctx // d, d).permute(0, 3, 2, 1)
        kernels.snake_into_phases(x, snake1.alpha, None, phases, ctx)
        if tails is not None:  # the next chunk's context: the last ctx positions, back in [B, C, ctx]
            q = torch.arange(L, ctx + L, device=x.device)
            tails[conv7.tail_id] = by_phase[:, q % d, q // d].transpose(1, 2)
        # NHWC [B * d, C, 1, J - K + 1]: position p + d * j
        y = F.conv2d(phases.transpose(1, 2).unsqueeze(2), conv7.channels_last_weight())
        h = kernels.snake_from_phases(y.squeeze(2).transpose(1, 2).contiguous(), snake2.alpha, conv7.conv.bias, B, L)
        assert (J - K + 1) * d >= L
        return kernels.bias_residual(x, conv1.run(h, bias=False), conv1.conv.bias)

    def _biases_in_kernels(self, x: torch.Tensor, tails: Tails | None) -> torch.Tensor:
        # The same unit with each conv's bias added by the pass after it: Snake(x + b7), x + (conv1 + b1).
        snake1, conv7, snake2, conv1 = self._parts()
        h = kernels.snake(x, snake1.alpha)
        h = conv7(h, bias=False) if tails is None else conv7.step(h, tails, bias=False)
        h = kernels.snake(h, snake2.alpha, conv7.conv.bias)
        return kernels.bias_residual(x, conv1.run(h, bias=False), conv1.conv.bias)

    def _with_kernels(self, x: torch.Tensor, tails: Tails | None) -> torch.Tensor:
        return self._through_phases(x, tails) if self._phased(x) else self._biases_in_kernels(x, tails)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, C, L]; causal convs keep the length, so no cropping of the skip path is needed
        if self._fused(x):
            return self._with_kernels(x, None)
        return x + self.block(x)

    def step(self, x: torch.Tensor, tails: Tails) -> torch.Tensor:
        if self._fused(x):
            return self._with_kernels(x, tails)
        return x + step_sequence(self.block, x, tails)
