"""The formats libsndfile does not read or write, through an ffmpeg binary: decoding reference clips from phones
(MP4/M4A with AAC) and browsers (WebM with Opus), and streaming AAC (ADTS) output.

The binary is the system's `ffmpeg` on PATH, else the one the `imageio-ffmpeg` wheel ships. ffmpeg is driven directly,
not through a wrapper library: the input's container is named explicitly (from its leading bytes) and only the `file`
and `pipe` protocols are allowed, so an upload cannot make ffmpeg open anything else (a playlist naming local files or
URLs); the decode is bounded in time, channels and rate before it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DECODE_TIMEOUT_SECONDS = 60.0  # a clip of at most a few minutes decodes in well under a second
AAC_BITRATE = "128k"
_QUIET = ["-nostdin", "-hide_banner", "-loglevel", "error"]


class FfmpegError(RuntimeError):
    """ffmpeg is missing or refused the input; `str(e)` says which, in a sentence for the user."""


def ffmpeg_binary() -> str | None:
    """The system's ffmpeg, else imageio-ffmpeg's; None when there is neither."""
    path = shutil.which("ffmpeg")
    if path is not None:
        return path
    try:
        import imageio_ffmpeg  # type: ignore[import-untyped]

        exe = imageio_ffmpeg.get_ffmpeg_exe()
    except (ImportError, RuntimeError):
        return None
    return str(exe) if exe and os.access(exe, os.X_OK) else None


MISSING = "it needs ffmpeg: install the system's ffmpeg or `pip install imageio-ffmpeg`"


def require_binary() -> str:
    exe = ffmpeg_binary()
    if exe is None:
        raise FfmpegError(MISSING)
    return exe


# -------------------------------------------------------------------------------------------------------- sniffing


@dataclass(frozen=True)
class Container:
    """What a file's leading bytes say it is: a name for messages, the ffmpeg demuxer that reads it."""

    name: str
    demuxer: str


def sniff(data: bytes) -> Container | None:
    """The container of an audio file from its first bytes (None: not one rtts knows)."""
    head = data[:64]
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return Container("WAV", "wav")
    if head[:4] == b"fLaC":
        return Container("FLAC", "flac")
    if head[:4] == b"OggS":
        kind = "Ogg Opus" if b"OpusHead" in head else "Ogg Vorbis" if b"\x01vorbis" in head else "Ogg"
        return Container(kind, "ogg")
    if head[4:8] == b"ftyp":
        brand = head[8:12].decode("latin-1").strip()
        name = "M4A (MP4 audio)" if brand in ("M4A", "M4B", "M4P") else f"MP4/MOV ({brand or 'no brand'})"
        return Container(name, "mov")
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return Container("WebM" if b"webm" in head else "Matroska", "matroska")
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return Container("AIFF", "aiff")
    if head[:4] == b"caff":
        return Container("CAF", "caf")
    if head[:6] == b"#!AMR\n":
        return Container("AMR", "amr")
    if head[:3] == b"ID3":
        return Container("MP3", "mp3")
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        # MPEG audio sync: layer bits 00 is ADTS AAC, anything else an MPEG layer I-III frame.
        return Container("AAC (ADTS)", "aac") if head[1] & 0x06 == 0 else Container("MP3", "mp3")
    return None


def describe_unknown(data: bytes) -> str:
    """An unknown file's first bytes, for an error message."""
    return "an unrecognised format (first bytes " + (data[:8].hex(" ") or "none") + ")"


# -------------------------------------------------------------------------------------------------------- decoding


def decode(data: bytes | Path, container: Container, sample_rate: int, max_seconds: float | None) -> np.ndarray:
    """The first audio stream of `data` (bytes, or a file) -> mono float32 at `sample_rate`, decoded by ffmpeg.

    With `max_seconds`, at most one second more than that is decoded: longer input comes back longer than the limit
    (for the caller to refuse) without ever being decoded whole.
    """
    exe = require_binary()
    with contextlib.ExitStack() as stack:
        if isinstance(data, Path):
            path = str(data)
        else:
            # A file rather than a pipe: MP4 keeps its index at the end, which ffmpeg reaches by seeking.
            tmp = stack.enter_context(tempfile.NamedTemporaryFile(prefix="rtts-clip-", suffix=".bin"))
            tmp.write(data)
            tmp.flush()
            path = tmp.name
        cmd = [exe, *_QUIET, "-protocol_whitelist", "file,pipe", "-f", container.demuxer, "-i", "file:" + path,
               "-map", "0:a:0", "-vn", "-ac", "1", "-ar", str(sample_rate)]
        if max_seconds is not None:
            cmd += ["-t", f"{max_seconds + 1.0:g}"]
        cmd += ["-f", "f32le", "pipe:1"]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=DECODE_TIMEOUT_SECONDS, check=False)
        except subprocess.TimeoutExpired:
            raise FfmpegError(f"ffmpeg took over {DECODE_TIMEOUT_SECONDS:g} s") from None
        except OSError as e:
            raise FfmpegError(f"ffmpeg could not run ({e})") from None
    if done.returncode != 0:
        message = _last_line(done.stderr).replace("file:" + path, "the input")  # not the temporary file's name
        raise FfmpegError(message or f"ffmpeg exited with status {done.returncode}")
    return np.frombuffer(done.stdout, dtype="<f4").astype(np.float32)


def _last_line(stderr: bytes) -> str:
    lines = [ln.strip() for ln in stderr.decode("utf-8", "replace").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


# -------------------------------------------------------------------------------------------------------- encoding

Emit = Callable[[bytes], Awaitable[None]]


class AacStream:
    """Streaming AAC-LC in ADTS frames from one ffmpeg process: `push` 16-bit PCM as it comes, `finish` once.

    ffmpeg writes each encoded packet at once (-flush_packets), so audio leaves about one AAC frame (1024 samples)
    plus the encoder's look-ahead after the PCM that makes it. A reader task hands every piece of output to `emit`.
    """

    def __init__(self, sample_rate: int, emit: Emit) -> None:
        self.sample_rate = sample_rate
        self._emit = emit
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._stderr = b""

    async def start(self) -> None:
        exe = require_binary()
        cmd = [exe, *_QUIET, "-probesize", "32", "-analyzeduration", "0", "-f", "s16le", "-ar", str(self.sample_rate),
               "-ac", "1", "-i", "pipe:0", "-c:a", "aac", "-b:a", AAC_BITRATE, "-f", "adts", "-flush_packets", "1",
               "pipe:1"]
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        except OSError as e:
            raise FfmpegError(f"ffmpeg could not run ({e})") from None
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        while chunk := await self._proc.stdout.read(1 << 16):
            await self._emit(chunk)

    async def push(self, pcm_s16: bytes) -> None:
        proc = self._running()
        assert proc.stdin is not None
        try:
            proc.stdin.write(pcm_s16)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            raise FfmpegError(await self._failure()) from None

    async def finish(self) -> None:
        """End of input: wait for ffmpeg's last frames and its exit."""
        proc = self._running()
        assert proc.stdin is not None and self._reader is not None
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            proc.stdin.close()
            await proc.stdin.wait_closed()
        await self._reader
        if await proc.wait() != 0:
            raise FfmpegError(await self._failure())

    def abort(self) -> None:
        """Stop at once (the client went away or synthesis failed); safe to call at any time, more than once."""
        if self._reader is not None:
            self._reader.cancel()
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            with contextlib.suppress(RuntimeError):  # reap it (no running loop: the child watcher does)
                asyncio.get_running_loop().create_task(self._proc.wait())

    def _running(self) -> asyncio.subprocess.Process:
        if self._proc is None:
            raise RuntimeError("AacStream used before start()")
        return self._proc

    async def _failure(self) -> str:
        proc = self._running()
        if proc.stderr is not None:
            with contextlib.suppress(Exception):
                self._stderr = await asyncio.wait_for(proc.stderr.read(), 5.0)
        return "AAC encoder failed: " + (_last_line(self._stderr) or f"ffmpeg exited with status {proc.returncode}")
