"""flite `cmu_us_rms` (Debian `flite`, BSD-style licence): a portable bundle and parallel synthesis with phone timings.

The GPU machine has no network and no apt, so `bundle` copies the per-voice binary `flite_cmu_us_rms` and every
shared library `ldd` says it loads (the flite libraries and libasound; not the C library, which every Linux has) into
one folder that travels with the repository. `synthesize` runs one flite process per sentence in a pool of workers and
keeps the `-psdur` phone end times (phone:seconds pairs on stdout) beside the 16 kHz audio.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import wave
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import numpy as np

VOICE_BINARY = "flite_cmu_us_rms"
SAMPLE_RATE = 16000
# Loaded from the host on any Linux: never copied (a foreign libc breaks the binary instead of helping it).
_SYSTEM_LIBS = re.compile(r"^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so)")


@dataclass(frozen=True)
class Flite:
    """How to run the voice: the binary and, for a bundle, the folder its libraries are in."""

    binary: Path
    lib_dir: Path | None = None

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        if self.lib_dir is not None:
            env["LD_LIBRARY_PATH"] = f"{self.lib_dir}:{env.get('LD_LIBRARY_PATH', '')}".rstrip(":")
        return env


def find(bundle: Path | None = None) -> Flite:
    """The bundle at `bundle` if it holds the binary, else the system's `flite_cmu_us_rms`."""
    if bundle is not None and (bundle / VOICE_BINARY).is_file():
        return Flite(bundle / VOICE_BINARY, bundle / "lib")
    found = shutil.which(VOICE_BINARY)
    if found is None:
        raise FileNotFoundError(f"{VOICE_BINARY} not found (apt-get install flite, or pass a bundle made by "
                                "`python -m rtts.train flite-bundle`)")
    return Flite(Path(found))


def bundle(out: Path) -> Path:
    """Copy the system's voice binary and its non-libc shared libraries into out/ (binary) and out/lib/."""
    binary = shutil.which(VOICE_BINARY)
    if binary is None:
        raise FileNotFoundError(f"{VOICE_BINARY} not found: apt-get install flite")
    listing = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
    (out / "lib").mkdir(parents=True, exist_ok=True)
    for line in listing.splitlines():
        m = re.match(r"\s*(\S+)\s+=>\s+(\S+)", line)
        if m and not _SYSTEM_LIBS.match(m.group(1)):
            shutil.copy(Path(m.group(2)).resolve(), out / "lib" / m.group(1))  # under the soname the binary asks for
    shutil.copy(binary, out / VOICE_BINARY)
    licence = Path("/usr/share/doc/libflite1/copyright")
    if licence.is_file():
        shutil.copy(licence, out / "COPYRIGHT.flite")
    return out


def parse_psdur(stdout: str) -> list[tuple[str, float]]:
    """'pau:0.176 dh:0.284 ...' -> [(phone, end time in seconds)]."""
    out: list[tuple[str, float]] = []
    for item in stdout.split():
        phone, _, end = item.rpartition(":")
        if phone:
            out.append((phone, float(end)))
    return out


@dataclass(frozen=True)
class Spoken:
    text: str
    audio: np.ndarray  # int16 [N] at SAMPLE_RATE
    phones: list[tuple[str, float]]


def speak(flite: Flite, text: str, workdir: Path) -> Spoken:
    """One sentence through flite -> 16 kHz int16 audio and its phone end times."""
    with tempfile.NamedTemporaryFile(suffix=".wav", dir=workdir) as tmp:
        done = subprocess.run([str(flite.binary), "-psdur", "-t", text, "-o", tmp.name], env=flite.env(),
                              capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            raise RuntimeError(f"flite failed ({done.returncode}) on {text!r}: {done.stderr.strip()[:200]}")
        with wave.open(tmp.name, "rb") as w:  # the standard library's reader: the GPU image has no soundfile
            rate, width, channels = w.getframerate(), w.getsampwidth(), w.getnchannels()
            audio = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    if (width, channels) != (2, 1):
        raise RuntimeError(f"flite wrote {channels} channels of {8 * width}-bit audio, expected 16-bit mono")
    if rate != SAMPLE_RATE:
        raise RuntimeError(f"flite wrote {rate} Hz, expected {SAMPLE_RATE}")
    return Spoken(text, np.asarray(audio, dtype=np.int16), parse_psdur(done.stdout))


_worker_flite: Flite | None = None
_worker_dir: Path | None = None


def _init_worker(flite: Flite, workdir: str) -> None:
    global _worker_flite, _worker_dir
    _worker_flite, _worker_dir = flite, Path(workdir)


def _speak_in_worker(text: str) -> Spoken | str:
    assert _worker_flite is not None and _worker_dir is not None
    try:
        return speak(_worker_flite, text, _worker_dir)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return str(e)


def synthesize(flite: Flite, texts: list[str], processes: int, max_failures: int = 0) -> Iterator[Spoken]:
    """Speak every text, in order, with `processes` flite processes running at a time. Up to `max_failures`
    sentences flite fails on are skipped (reported on stderr) rather than ending a long run."""
    failures = 0

    def check(result: Spoken | str) -> Spoken | None:
        nonlocal failures
        if isinstance(result, Spoken):
            return result
        failures += 1
        print(f"flite: skipped a sentence ({result})", file=sys.stderr)
        if failures > max_failures:
            raise RuntimeError(f"flite failed on {failures} sentences: {result}")
        return None

    with tempfile.TemporaryDirectory(prefix="rtts-flite-") as workdir:
        _init_worker(flite, workdir)
        if processes <= 1:
            results: Iterator[Spoken | str] = map(_speak_in_worker, texts)
            for r in results:
                if (ok := check(r)) is not None:
                    yield ok
            return
        ctx = get_context("spawn")  # no torch state forked into the workers
        with ctx.Pool(processes, initializer=_init_worker, initargs=(flite, workdir)) as pool:
            for r in pool.imap(_speak_in_worker, texts, chunksize=8):
                if (ok := check(r)) is not None:
                    yield ok
