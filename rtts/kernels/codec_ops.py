"""The codec's elementwise ops as single kernels: Snake (cuda/snake.cu)."""

from __future__ import annotations

import torch

from rtts.kernels import _jit, reference
from rtts.kernels.common import check, i32, use_cuda

_SNAKE_TYPES = {torch.float32: "float", torch.bfloat16: "bf16_t", torch.float16: "f16_t"}
SNAKE_DTYPES = frozenset(_SNAKE_TYPES)  # what snake() takes (other dtypes: the caller's torch expression)
_SNAKE_INSTANCES = tuple(f"snake<{t}, {v}>" for t in _SNAKE_TYPES.values() for v in (4, 1))


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The codec's Snake activation in one pass (cuda/snake.cu): x [B, C, L] contiguous float32, bf16 or fp16, alpha [C]
    (any float dtype; its float32 copy is what the kernel reads) -> x + sin(alpha x)^2 / (alpha + 1e-9)."""
    check(x.dim() == 3 and x.is_contiguous() and x.dtype in _SNAKE_TYPES,
          lambda: f"snake: want a contiguous float32, bfloat16 or float16 [B, C, L], got {x.dtype} {tuple(x.shape)} "
                  f"(contiguous: {x.is_contiguous()})")
    B, C, L = x.shape
    check(alpha.numel() == C and alpha.is_floating_point(),
          lambda: f"snake: alpha must hold {C} floats (one per channel), got {alpha.dtype} {tuple(alpha.shape)}")
    if not use_cuda(x, alpha):
        return reference.snake(x, alpha.reshape(C).to(x.dtype))
    a = alpha.reshape(C).to(device=x.device, dtype=torch.float32).contiguous()
    y = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return y
    vec = 4 if L % 4 == 0 and x.data_ptr() % 16 == 0 and y.data_ptr() % 16 == 0 else 1
    fn = _jit.function("snake.cu", f"snake<{_SNAKE_TYPES[x.dtype]}, {vec}>", _SNAKE_INSTANCES)
    _jit.launch(fn, (-(-n // (256 * vec)),), (256,), (x.data_ptr(), a.data_ptr(), y.data_ptr(), n, i32(C), i32(L)))
    return y


def warmup() -> None:
    for inst in _SNAKE_INSTANCES:
        _jit.function("snake.cu", inst, _SNAKE_INSTANCES)
