"""The codec's elementwise ops as single kernels: Snake (cuda/snake.cu), optionally after the bias of the convolution
before it, also into and out of a dilated convolution's phase layout, and the residual unit's bias + skip add
(cuda/codec_residual.cu).

Phase layout (rtts/model/codec_conv.py: a dilation-d conv as an undilated conv over the d interleaved phases of its
input, channels last as cuDNN's tensor-core kernels read them): position q of a [B, C, *] signal lives at
[b * d + q % d, q // d, c] of a [B * d, J, C] tensor."""

from __future__ import annotations

import torch

from rtts import env
from rtts.kernels import _jit, reference
from rtts.kernels.common import check, i32, use_cuda

_TYPES = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}
SNAKE_DTYPES = frozenset(_TYPES)  # what the codec kernels take (other dtypes: the caller's torch expression)
# every instance of a file's templates, compiled together (one module per file)
_SNAKE_INSTANCES = (*(f"snake<{t}, {v}>" for t in _TYPES.values() for v in (4, 1)),
                    *(f"snake_{way}_phases<{t}, {v}>" for t in _TYPES.values() for way in ("to", "from")
                      for v in (2, 1)))
_RESIDUAL_INSTANCES = tuple(f"bias_residual<{t}, {v}>" for t in _TYPES.values() for v in (4, 1))


def row_stride(x: torch.Tensor) -> int | None:
    """The distance between the rows (one channel of one batch entry) of x [B, C, L] when every row is contiguous and
    the rows are evenly spaced (a contiguous tensor, or a slice of one along L), else None: the layouts the codec
    kernels read."""
    if x.dim() != 3:
        return None
    B, C, L = x.shape
    if L > 1 and x.stride(2) != 1:
        return None
    row = x.stride(1) if C > 1 else (x.stride(0) if B > 1 else L)
    if row < L or (B > 1 and x.stride(0) != C * row):
        return None
    return row


def fits_kernels(x: torch.Tensor) -> bool:
    """x can go to the codec kernels as it is: a float32 / bfloat16 / float16 [B, C, L] with evenly spaced rows."""
    return x.dtype in _TYPES and row_stride(x) is not None


def _per_channel(t: torch.Tensor | None, C: int, what: str) -> torch.Tensor | None:
    if t is None:
        return None
    check(t.numel() == C and t.is_floating_point(),
          lambda: f"{what} must hold {C} floats (one per channel), got {t.dtype} {tuple(t.shape)}")
    return t.reshape(C)


def _channel_params(alpha: torch.Tensor, bias: torch.Tensor | None, C: int, what: str
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """alpha and the optional bias, each checked to hold C floats -> both reshaped to [C]."""
    a = _per_channel(alpha, C, f"{what}: alpha")
    assert a is not None
    return a, _per_channel(bias, C, f"{what}: bias")


def _given(*ts: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    return tuple(t for t in ts if t is not None)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _vec(L: int, row: int, *tensors: torch.Tensor) -> int:
    aligned = all(t.data_ptr() % 16 == 0 for t in tensors)
    return 4 if L % 4 == 0 and row % 4 == 0 and aligned else 1


def _launch_by_rows(file: str, kernel: str, instances: tuple[str, ...], out: torch.Tensor, row: int,
                    tensors: tuple[torch.Tensor, ...], args: tuple[object, ...]) -> None:
    """Launch `kernel<type, VEC>` of `file` over out [B, C, L] (one thread per VEC elements of a row), VEC = 4 where
    L, the input row stride and every one of `tensors`' pointers allow; `args` follow the kernel's signature."""
    n, L = out.numel(), out.shape[-1]
    vec = _vec(L, row, *tensors)
    fn = _jit.function(file, f"{kernel}<{_TYPES[out.dtype]}, {vec}>", instances)
    _jit.launch(fn, (-(-n // (256 * vec)),), (256,), args)


def _f32(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device=device, dtype=torch.float32).contiguous()


def _kernel_params(a: torch.Tensor, b: torch.Tensor | None, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """What the kernels read: alpha and the optional bias as float32 on the device (held by the caller until the
    launch: a converted copy freed earlier could be reused by the output's allocation)."""
    a32 = _f32(a, device)
    assert a32 is not None
    return a32, _f32(b, device)


def snake(x: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The codec's Snake activation in one pass (cuda/snake.cu): x [B, C, L] float32, bf16 or fp16 with contiguous,
    evenly spaced rows (`row_stride`), alpha [C] and optional bias [C] (any float dtype; the kernel reads their
    float32 copies) -> snake(x + bias) = v + sin(alpha v)^2 / (alpha + 1e-9) with v = x + bias, contiguous."""
    row = row_stride(x)
    check(x.dtype in _TYPES and row is not None,
          lambda: f"snake: want a float32, bfloat16 or float16 [B, C, L] with contiguous rows, got {x.dtype} "
                  f"{tuple(x.shape)} strides {x.stride()}")
    assert row is not None
    B, C, L = x.shape
    a, b = _channel_params(alpha, bias, C, "snake")
    if not use_cuda(x, *_given(alpha, bias)):
        v = x if b is None else x + b.to(x.dtype).view(1, C, 1)
        return reference.snake(v, a.to(x.dtype))
    a32, b32 = _kernel_params(a, b, x.device)
    y = torch.empty(B, C, L, dtype=x.dtype, device=x.device)
    if y.numel():
        _launch_by_rows("snake.cu", "snake", _SNAKE_INSTANCES, y, row, (x, y),
                        (x.data_ptr(), a32.data_ptr(), _ptr(b32), y.data_ptr(), y.numel(), i32(C), i32(L), row))
    return y


def _phase_view(phases: torch.Tensor, B: int, d: int) -> torch.Tensor:
    """[B * d, J, C] -> [B, d, J, C]: phase p of batch entry b at [b, p]."""
    return phases.view(B, d, *phases.shape[1:])


_TILE, _ROWS = 32, 8  # cuda/snake.cu TILE, ROWS


def _tiles(L: int, C: int, B: int, v: int) -> tuple[tuple[int, int, int], tuple[int, int]]:
    return (-(-L // (_TILE * v)), -(-C // (_TILE * v)), B), (_TILE, _ROWS)


def _pairs(C: int, *sizes: int, tensors: tuple[torch.Tensor, ...]) -> int:
    """The phase kernels' elements per access: 2 where the switch is on and C, every size (lengths, row strides) and
    every pointer allow a vector that never straddles a row; else 1."""
    ok = (env.kernel_switches().codec_tile_pairs and C % 2 == 0 and all(n % 2 == 0 for n in sizes)
          and all(t.data_ptr() % (2 * t.element_size()) == 0 for t in tensors))
    return 2 if ok else 1


def snake_into_phases(x: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None, phases: torch.Tensor,
                      start: int) -> None:
    """phases [B * d, J, C] (phase layout, channels last, contiguous) at positions start .. start + L - 1 <-
    snake(x + bias), x [B, C, L] with evenly spaced contiguous rows; the other positions keep what they hold
    (cuda/snake.cu, snake_to_phases)."""
    rows = row_stride(x)
    if x.dim() == 3 and x.shape[0] == 0:
        return
    check(x.dtype in _TYPES and rows is not None and phases.dtype == x.dtype and phases.dim() == 3
          and phases.is_contiguous() and phases.shape[0] % x.shape[0] == 0
          and phases.shape[2] == x.shape[1],
          lambda: f"snake_into_phases: want x [B, C, L] with contiguous rows and phases [B * d, J, C] contiguous, of "
                  f"one float32, bfloat16 or float16; got {x.dtype} {tuple(x.shape)} strides {x.stride()} and "
                  f"{phases.dtype} {tuple(phases.shape)}")
    B, C, L = x.shape
    d, J = phases.shape[0] // B, phases.shape[1]
    check(0 <= start and start + L <= d * J, lambda: f"snake_into_phases: positions {start}..{start + L} past {d * J}")
    a, b = _channel_params(alpha, bias, C, "snake_into_phases")
    if not use_cuda(x, phases, *_given(alpha, bias)):
        v = x if b is None else x + b.to(x.dtype).view(1, C, 1)
        q = torch.arange(start, start + L, device=x.device)
        _phase_view(phases, B, d)[:, q % d, q // d] = reference.snake(v, a.to(x.dtype)).transpose(1, 2)
        return
    a32, b32 = _kernel_params(a, b, x.device)
    assert rows is not None
    if L == 0 or C == 0:
        return
    vec = _pairs(C, L, rows, tensors=(x, phases))
    fn = _jit.function("snake.cu", f"snake_to_phases<{_TYPES[x.dtype]}, {vec}>", _SNAKE_INSTANCES)
    _jit.launch(fn, *_tiles(L, C, B, vec),
                (x.data_ptr(), a32.data_ptr(), _ptr(b32), phases.data_ptr(), i32(C), i32(L), rows, i32(d), i32(J),
                 i32(start)))


def snake_from_phases(phases: torch.Tensor, alpha: torch.Tensor, bias: torch.Tensor | None, batch: int,
                      length: int) -> torch.Tensor:
    """snake(x + bias) of the signal x held in phase layout by phases [batch * d, J, C] (channels last, contiguous: a
    phased conv's output), at positions 0 .. length - 1 -> [batch, C, length] contiguous (cuda/snake.cu,
    snake_from_phases)."""
    check(phases.dtype in _TYPES and phases.dim() == 3 and phases.is_contiguous() and batch > 0
          and phases.shape[0] % batch == 0 and 0 <= length <= phases.shape[0] // batch * phases.shape[1],
          lambda: f"snake_from_phases: want phases [batch * d, J, C] contiguous float32, bfloat16 or float16 holding "
                  f"{length} positions for batch {batch}, got {phases.dtype} {tuple(phases.shape)}")
    d, J, C = phases.shape[0] // batch, phases.shape[1], phases.shape[2]
    a, b = _channel_params(alpha, bias, C, "snake_from_phases")
    if not use_cuda(phases, *_given(alpha, bias)):
        v = _phase_view(phases, batch, d).permute(0, 3, 2, 1).reshape(batch, C, J * d)[..., :length]
        if b is not None:
            v = v + b.to(v.dtype).view(1, C, 1)
        return reference.snake(v, a.to(v.dtype))
    a32, b32 = _kernel_params(a, b, phases.device)
    y = torch.empty(batch, C, length, dtype=phases.dtype, device=phases.device)
    if y.numel() == 0:
        return y
    vec = _pairs(C, length, tensors=(phases, y))
    fn = _jit.function("snake.cu", f"snake_from_phases<{_TYPES[phases.dtype]}, {vec}>", _SNAKE_INSTANCES)
    _jit.launch(fn, *_tiles(length, C, batch, vec),
                (phases.data_ptr(), a32.data_ptr(), _ptr(b32), y.data_ptr(), i32(C), i32(length), i32(d), i32(J)))
    return y


def bias_residual(x: torch.Tensor, y: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x + (y + bias) in one pass (cuda/codec_residual.cu): the residual unit's skip input x [B, C, L] (contiguous,
    evenly spaced rows), its last convolution's output y [B, C, L] contiguous, run without its bias [C]; the result
    is contiguous."""
    row = row_stride(x)
    check(x.dtype in _TYPES and row is not None and y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous(),
          lambda: f"bias_residual: want x and y of one float32, bfloat16 or float16 [B, C, L] (x's rows contiguous, "
                  f"y contiguous), got {x.dtype} {tuple(x.shape)} strides {x.stride()} and {y.dtype} "
                  f"{tuple(y.shape)} strides {y.stride()}")
    assert row is not None
    B, C, L = x.shape
    b = _per_channel(bias, C, "bias_residual: bias")
    if not use_cuda(x, y, *_given(bias)):
        return reference.bias_residual(x, y, None if b is None else b.to(x.dtype))
    b32 = _f32(b, x.device)
    out = torch.empty(B, C, L, dtype=x.dtype, device=x.device)
    if out.numel():
        _launch_by_rows("codec_residual.cu", "bias_residual", _RESIDUAL_INSTANCES, out, row, (x, y, out),
                        (x.data_ptr(), y.data_ptr(), _ptr(b32), out.data_ptr(), out.numel(), i32(C), i32(L), row))
    return out


def warmup() -> None:
    for inst in _SNAKE_INSTANCES:
        _jit.function("snake.cu", inst, _SNAKE_INSTANCES)
    for inst in _RESIDUAL_INSTANCES:
        _jit.function("codec_residual.cu", inst, _RESIDUAL_INSTANCES)
