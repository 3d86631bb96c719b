"""Hot GPU ops: CUDA C++ in `cuda/*.cu`, compiled at run time through CuPy, each with a pure-torch reference.

Every op checks shapes, dtypes and layouts strictly (no silent unsqueeze, cast or copy), then runs the CUDA kernel
when `_jit.available()` and the tensors live on the GPU, else the reference in `reference.py` (the CPU path, and what
`RTTS_REFERENCE_KERNELS=1` forces everywhere). Only `_jit.py` imports CuPy.

This module is the API the model and engine use. The ops live by concern:

- `gemm.py`: the FP8 GEMM (dispatch, launch plans over `gemm_plan.py`, split-tile scratch, weight packing);
- `quant.py`: activation quantization (plain and fused with SwiGLU) and weight dequantization;
- `attention.py`: split-KV decode attention and its planner;
- `norm_rope.py`: RMSNorm (+ residual, + quantization) and QK-norm + RoPE + KV store;
- `draw.py`: the sampling draw and the token window; `rng.py`: its counter-based noise;
- `codec_ops.py`: the codec's Snake activation (after an optional bias) and its residual unit's bias + skip add;
- `common.py`: what the wrappers share; `_jit.py`: compiling and launching; `reference.py`: the torch references.
"""

from __future__ import annotations

import torch

from rtts.kernels import _jit, attention, codec_ops, draw, gemm, norm_rope, quant
from rtts.kernels.attention import decode_attention, decode_attention_fast
from rtts.kernels.codec_ops import (
    SNAKE_DTYPES,
    bias_residual,
    fits_kernels,
    snake,
    snake_from_phases,
    snake_into_phases,
)
from rtts.kernels.draw import token_window_shift
from rtts.kernels.gemm import (
    fp8_gemm,
    fp8_linear,
    fp8_rows_dense,
    fp8_runs_dense,
    graph_scratch,
    pack_weight,
    prepare_weight,
    reserve_graph_scratch,
)
from rtts.kernels.quant import dequantize_weight, quantize_1x128, swiglu_quantize

__all__ = [
    "SNAKE_DTYPES",
    "bias_residual",
    "decode_attention",
    "decode_attention_fast",
    "dequantize_weight",
    "fits_kernels",
    "fp8_gemm",
    "fp8_linear",
    "fp8_rows_dense",
    "fp8_runs_dense",
    "graph_scratch",
    "pack_weight",
    "prepare_weight",
    "quantize_1x128",
    "reserve_graph_scratch",
    "snake",
    "snake_from_phases",
    "snake_into_phases",
    "swiglu_quantize",
    "token_window_shift",
    "warmup",
]


def warmup(device: torch.device) -> None:
    """Compile and load every kernel module now, and allocate the GEMM's split scratch (before any CUDA-graph
    capture)."""
    if device.type != "cuda" or not _jit.available():
        return
    quant.warmup()
    codec_ops.warmup()
    gemm.warmup(device)
    attention.warmup()
    norm_rope.warmup()
    draw.warmup()
