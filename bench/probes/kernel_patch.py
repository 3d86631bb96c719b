"""Shared by the GEMM probes: edit the text of a GEMM kernel (`cuda/fp8_gemm_wgmma.cu` unless told) in memory before
NVRTC compiles it.

Each edit is (anchor, replacement); an anchor that no longer matches the kernel fails loudly, naming the probe to
update (move the anchor, not the kernel). The repository file is never touched.
"""

from __future__ import annotations

from collections.abc import Callable

from rtts.kernels import _jit

KERNEL = "fp8_gemm_wgmma.cu"


def patch_gemm(text: str, edits: list[tuple[str, str]], probe: str, exit_stmt: str | None = None) -> str:
    """`text` with every edit applied, and `exit_stmt` inserted as the last statement of the GEMM: the end of gemm_body
    (fp8_gemm_wgmma.cu), else of the file's last function (fp8_gemm_wgmma64.cu: the kernel)."""
    for a, b in edits:
        if a not in text:
            raise SystemExit(f"anchor not found in the kernel (update bench/probes/{probe}): {a!r}")
        text = text.replace(a, b, 1)
    if exit_stmt is not None:
        stop = text.index("#define GEMM_PARAMS") if "#define GEMM_PARAMS" in text else len(text)
        end = text.rindex("}", 0, stop)  # the closing brace of gemm_body / the kernel
        text = text[:end] + exit_stmt + text[end:]
    return text


def gemm_source(edits: list[tuple[str, str]], probe: str, exit_stmt: str | None = None,
                original: Callable[[str], str] = _jit.source, kernel: str = KERNEL) -> Callable[[str], str]:
    """A stand-in for `_jit.source` that serves `kernel` patched and every other source as `original` does (so two
    patched kernels chain: pass one gemm_source as the other's `original`)."""

    def source(name: str) -> str:
        text = original(name)
        return patch_gemm(text, edits, probe, exit_stmt) if name == kernel else text

    return source
