"""Every RTTS_* environment switch, typed, in one place (the only module that reads os.environ)."""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _on_unless_off(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("0", "false", "no", "off")


def _choice(name: str, allowed: tuple[str, str]) -> str:
    """The stripped value of a setting that must be one of `allowed` ("" when unset); anything else is an error
    rather than a silent default."""
    v = os.environ.get(name, "").strip()
    if v not in ("", *allowed):
        raise ValueError(f"{name} must be {allowed[0]} or {allowed[1]}, got {v!r}")
    return v


def codec_graphs() -> bool:
    """RTTS_CODEC_GRAPHS=0 turns off `rtts serve`'s audio chunk decodes from CUDA graphs (the default of
    --codec-graphs; pingpong/codec_graphs.py). On unless set off: on an H200 they cut WebSocket TTFA at 8 streams
    from 186 to 75 ms p50 with the prefill graphs (latency_reports/2026-11-30_4901bdd_*)."""
    return _on_unless_off("RTTS_CODEC_GRAPHS")


def prefill_graphs() -> bool:
    """RTTS_PREFILL_GRAPHS=0 turns off `rtts serve`'s prompt-chunk forwards from CUDA graphs (the default of
    --prefill-graphs; engine/graphs.PrefillRunner). On unless set off: on an H200 a turn's first audio at 16
    streams fell from 95 to 35 ms p50 (bench/results/graphs/)."""
    return _on_unless_off("RTTS_PREFILL_GRAPHS")


def codec_tf32() -> bool:
    """RTTS_CODEC_TF32=0: `rtts serve` decodes audio in true float32 on CUDA (the default of --codec-tf32; on
    unless set off: TF32 tensor cores decode a chunk 2.4x faster at 55.7 dB SNR, bench/results/codec/)."""
    return _on_unless_off("RTTS_CODEC_TF32")


def reference_kernels() -> bool:
    """RTTS_REFERENCE_KERNELS=1: run every op through its pure-torch reference (bisection, CPU)."""
    return _flag("RTTS_REFERENCE_KERNELS")


def legacy_gemm() -> bool:
    """RTTS_MMA_GEMM=1: run the FP8 GEMM through the mma.sync kernel even on Hopper (comparison, bisection); packed
    weights are unpacked per call then (correct, slow)."""
    return _flag("RTTS_MMA_GEMM")


def no_pdl() -> bool:
    """RTTS_NO_PDL=1: launch the GEMM without programmatic dependent launch (comparison, bisection)."""
    return _flag("RTTS_NO_PDL")


def gemm_tma_tokens() -> bool:
    """RTTS_GEMM_TMA_TOKENS=0: the lean 128-row FP8 GEMM instances (1-16 tokens, global stream-K) load their tokens by
    cp.async from every consumer instead of by tensor-map TMA from the producer thread (fp8_gemm_wgmma.cu, gemm_body;
    TMA is the default where the driver encodes tensor maps): comparison, bisection."""
    return _choice("RTTS_GEMM_TMA_TOKENS", ("0", "1")) != "0"


def gemm_token_major() -> bool | None:
    """RTTS_GEMM_TM: which GEMMs of at most 64 tokens run the token-major kernel (cuda/fp8_gemm_wgmma_tm.cu) instead
    of the stream-K kernels. Unset: the planner's choice (gemm_plan.prefer_token_major: whole-K plans from 9 tokens,
    cluster pairs from 9 as well, where each measured faster); 1: wherever it has a plan (comparison, tests); 0: never.
    Measured on the H200 (sessions 13-14, bench/results): wqkv 64 tokens 9.3 -> 6.8 us, wo 64 7.8 -> 5.8."""
    v = _choice("RTTS_GEMM_TM", ("0", "1"))
    return None if v == "" else v == "1"


def gemm_cluster() -> int | None:
    """RTTS_GEMM_CLUSTER=N: force the wgmma GEMM's split (1: global stream-K, 2-8: clusters of N CTAs) instead of
    its planner's choice (comparison, bisection)."""
    v = os.environ.get("RTTS_GEMM_CLUSTER", "").strip()
    return int(v) if v else None


def gemm_rows() -> int | None:
    """RTTS_GEMM_ROWS=64|128: force the wgmma GEMM's tile height (64: fp8_gemm_wgmma64, one warpgroup per 64-row
    tile, tokens through a ring; 128: fp8_gemm_wgmma, two warpgroups, tokens staged) for every token count, instead
    of the planner's choice (64 above 16 tokens): comparison, bisection."""
    v = _choice("RTTS_GEMM_ROWS", ("64", "128"))
    return int(v) if v else None


def kernel_cache_dir() -> str | None:
    """RTTS_KERNEL_CACHE_DIR: where compiled kernels are cached (CuPy's own cache otherwise)."""
    return os.environ.get("RTTS_KERNEL_CACHE_DIR") or None


def home() -> str | None:
    """RTTS_HOME: cache root for the default model and stored voices (default ~/.cache/rtts)."""
    return os.environ.get("RTTS_HOME") or None


def commit() -> str | None:
    """RTTS_COMMIT: commit id for benchmark records on machines without the git checkout."""
    return os.environ.get("RTTS_COMMIT") or None
