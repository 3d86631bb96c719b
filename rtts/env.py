"""Every RTTS_* environment switch, typed, in one place (the only module that reads os.environ).

- Kernel switches (`KernelSwitches`) are consulted on every kernel launch, so they are read once, when this module is
  imported; tests and probes change them at run time through `override_kernel_switches`, never through os.environ.
- Process settings (`home()`, the CLI defaults `codec_graphs()` / `prefill_graphs()` / `codec_tf32()`, ...) are read
  when asked: the CLI and the server ask once, at startup.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator, Mapping
from typing import Any


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _on_unless_off(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("0", "false", "no", "off")


def _choice(environ: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str:
    """The stripped value of a setting that must be one of `allowed` ("" when unset); anything else is an error
    rather than a silent default."""
    v = environ.get(name, "").strip()
    if v not in ("", *allowed):
        raise ValueError(f"{name} must be {' or '.join(allowed)}, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class KernelSwitches:
    """The switches rtts.kernels reads on every launch (comparison and bisection aids; the defaults are what ships)."""

    # RTTS_REFERENCE_KERNELS=1: run every op through its pure-torch reference (bisection, CPU).
    reference_kernels: bool = False
    # RTTS_MMA_GEMM=1: run the FP8 GEMM through the mma.sync kernel even on Hopper; packed weights are unpacked per
    # call then (correct, slow).
    legacy_gemm: bool = False
    # RTTS_NO_PDL=1: launch the GEMM without programmatic dependent launch.
    no_pdl: bool = False
    # RTTS_GEMM_TMA_TOKENS=0: the lean 128-row FP8 GEMM instances (1-16 tokens, global stream-K) load their tokens by
    # cp.async from every consumer instead of by tensor-map TMA from the producer thread (fp8_gemm_wgmma.cu,
    # gemm_body; TMA is the default where the driver encodes tensor maps).
    gemm_tma_tokens: bool = True
    # RTTS_GEMM_TM: which GEMMs of at most 64 tokens run the token-major kernel (cuda/fp8_gemm_wgmma_tm.cu) instead
    # of the stream-K kernels. Unset (None): the planner's choice (gemm_plan.prefer_token_major, where it measured
    # faster: bench/results/traces/README.md); 1: wherever it has a plan (comparison, tests); 0: never.
    gemm_token_major: bool | None = None
    # RTTS_GEMM_CLUSTER=N: force the wgmma GEMM's split (1: global stream-K, 2-8: clusters of N CTAs) instead of its
    # planner's choice.
    gemm_cluster: int | None = None
    # RTTS_GEMM_ROWS=64|128: force the wgmma GEMM's tile height (64: fp8_gemm_wgmma64, one warpgroup per 64-row
    # tile, tokens through a ring; 128: fp8_gemm_wgmma, two warpgroups, tokens staged) for every token count,
    # instead of the planner's choice (64 above 16 tokens).
    gemm_rows: int | None = None
    # RTTS_CODEC_POLYPHASE=0: the codec's dilated convs on a GPU run as cuDNN's dilated conv instead of an undilated
    # conv over their phases (rtts/model/codec_conv.py).
    codec_polyphase: bool = True
    # RTTS_CODEC_FUSED=0: the codec's residual units on a GPU add their convs' biases as torch does, in passes of
    # their own, instead of in the Snake and residual kernels.
    codec_fused: bool = True
    # On unless RTTS_CODEC_CHANNELS_LAST=0: with both of the above, a residual unit's k7 conv runs channels last over
    # its phases, written and read in place by the tiled Snake kernels (ResidualUnit._through_phases); 0 turns that
    # off (the phases are then permuted and padded by torch around cuDNN's NCHW conv).
    codec_channels_last: bool = True
    # RTTS_CODEC_TILE_PAIRS=1: the phase-layout Snake kernels move two elements per thread and access (64 x 64
    # tiles) where shapes and pointers allow, instead of one 2-byte access (32 x 32 tiles). Off until its GPU tests
    # and benchmark have run (`python -m rtts.bench kernels --sections codec`).
    codec_tile_pairs: bool = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> KernelSwitches:
        """The switches `environ` sets; a strict setting with a value it does not know raises ValueError."""
        tm = _choice(environ, "RTTS_GEMM_TM", ("0", "1"))
        cluster = environ.get("RTTS_GEMM_CLUSTER", "").strip()
        rows = _choice(environ, "RTTS_GEMM_ROWS", ("64", "128"))
        return cls(
            reference_kernels=_flag(environ, "RTTS_REFERENCE_KERNELS"),
            legacy_gemm=_flag(environ, "RTTS_MMA_GEMM"),
            no_pdl=_flag(environ, "RTTS_NO_PDL"),
            gemm_tma_tokens=_choice(environ, "RTTS_GEMM_TMA_TOKENS", ("0", "1")) != "0",
            gemm_token_major=None if tm == "" else tm == "1",
            gemm_cluster=int(cluster) if cluster else None,
            gemm_rows=int(rows) if rows else None,
            codec_polyphase=_choice(environ, "RTTS_CODEC_POLYPHASE", ("0", "1")) != "0",
            codec_fused=_choice(environ, "RTTS_CODEC_FUSED", ("0", "1")) != "0",
            codec_channels_last=_choice(environ, "RTTS_CODEC_CHANNELS_LAST", ("0", "1")) != "0",
            codec_tile_pairs=_choice(environ, "RTTS_CODEC_TILE_PAIRS", ("0", "1")) == "1",
        )


_kernel_switches = KernelSwitches.from_environ()


def kernel_switches() -> KernelSwitches:
    """The kernel switches in force: the environment's at import, unless overridden since."""
    return _kernel_switches


def set_kernel_switches(switches: KernelSwitches) -> KernelSwitches:
    """Put `switches` in force for the whole process (probes sweeping a switch); returns the ones they replace."""
    global _kernel_switches
    prev, _kernel_switches = _kernel_switches, switches
    return prev


def change_kernel_switches(**changes: Any) -> KernelSwitches:
    """Put the switches in force with `changes` (field names of KernelSwitches); returns the ones they replace."""
    return set_kernel_switches(dataclasses.replace(_kernel_switches, **changes))


@contextlib.contextmanager
def override_kernel_switches(**changes: Any) -> Iterator[KernelSwitches]:
    """The kernel switches with `changes` in force inside, for the whole process (tests, probes); the previous ones
    are restored on exit."""
    prev = change_kernel_switches(**changes)
    try:
        yield _kernel_switches
    finally:
        set_kernel_switches(prev)


def codec_graphs() -> bool:
    """RTTS_CODEC_GRAPHS=0 turns off `rtts serve`'s audio chunk decodes from CUDA graphs (the default of
    --codec-graphs; engine/graphs/codec.py). On unless set off: they cut time to first audio
    (bench/results/traces/README.md)."""
    return _on_unless_off("RTTS_CODEC_GRAPHS")


def prefill_graphs() -> bool:
    """RTTS_PREFILL_GRAPHS=0 turns off `rtts serve`'s prompt-chunk forwards from CUDA graphs (the default of
    --prefill-graphs; engine/graphs/prefill.py). On unless set off: they cut a turn's first audio
    (bench/results/graphs/)."""
    return _on_unless_off("RTTS_PREFILL_GRAPHS")


def codec_tf32() -> bool:
    """RTTS_CODEC_TF32=0: `rtts serve` decodes audio in true float32 on CUDA (the default of --codec-tf32; on unless
    set off: TF32 tensor cores decode much faster at a high SNR, bench/results/codec/)."""
    return _on_unless_off("RTTS_CODEC_TF32")


CODEC_DTYPES = ("auto", "float32", "float16", "bfloat16")


def codec_dtype() -> str:
    """RTTS_CODEC_DTYPE (auto, float32, float16, bfloat16): the precision `rtts serve` decodes audio in (the default of
    --codec-dtype). auto: float16 on CUDA, float32 on CPU; reference encoding always runs in float32."""
    return _choice(os.environ, "RTTS_CODEC_DTYPE", CODEC_DTYPES) or "auto"


def switch_interval() -> float | None:
    """RTTS_SWITCH_INTERVAL (seconds, > 0): the interpreter's GIL switch interval for `rtts serve` and the scheduler
    bench (rtts.startup.set_switch_interval); unset: the interpreter's own. A thread waiting for the GIL (the decode
    thread, to launch the next step) waits up to this long while another thread runs Python."""
    v = os.environ.get("RTTS_SWITCH_INTERVAL", "").strip()
    if not v:
        return None
    seconds = float(v)
    if not 0 < seconds <= 1:
        raise ValueError(f"RTTS_SWITCH_INTERVAL must be in (0, 1] seconds, got {v!r}")
    return seconds


def priority_streams() -> bool:
    """RTTS_PRIORITY_STREAMS=1: the scheduler's prefill and codec CUDA streams run at high priority (the default of
    SchedulerConfig.priority_streams; off unless set)."""
    return _flag(os.environ, "RTTS_PRIORITY_STREAMS")


def cpu_threads() -> int | None:
    """RTTS_CPU_THREADS (>= 1): torch's intra-op threads when the server runs on a CPU. Unset: half the cores (at
    least one), since the decode and codec threads each run torch ops at the same time; None (torch's own choice)
    when OMP_NUM_THREADS is set."""
    v = os.environ.get("RTTS_CPU_THREADS", "").strip()
    if v:
        n = int(v)
        if n < 1:
            raise ValueError(f"RTTS_CPU_THREADS must be >= 1, got {v!r}")
        return n
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return None
    return max(1, (os.cpu_count() or 2) // 2)


def kernel_cache_dir() -> str | None:
    """RTTS_KERNEL_CACHE_DIR: where compiled kernels are cached (CuPy's own cache otherwise); read when CuPy loads."""
    return os.environ.get("RTTS_KERNEL_CACHE_DIR") or None


def home() -> str | None:
    """RTTS_HOME: the root of the stored voices, `$RTTS_HOME/voices` (default ~/.cache/rtts)."""
    return os.environ.get("RTTS_HOME") or None


def commit() -> str | None:
    """RTTS_COMMIT: commit id for benchmark records on machines without the git checkout."""
    return os.environ.get("RTTS_COMMIT") or None
