"""Reference clips in the formats phones and browsers record (M4A/AAC, WebM/Opus from MediaRecorder), read through
ffmpeg after libsndfile: the system's binary or the one imageio-ffmpeg ships; and a clear error naming the format when
nothing reads a clip. (The demo page's upload of a WebM recording to a server: tests/test_browser_demo.py.)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from conftest import system_tool

from rtts.audio import ffmpeg
from rtts.audio.io import AudioError, read_audio

RATE = 44100
SECONDS = 1.2


def _bundled_only(monkeypatch: pytest.MonkeyPatch) -> str:
    """Hide the system's ffmpeg: the binary is imageio-ffmpeg's."""
    monkeypatch.setattr(ffmpeg.shutil, "which", lambda name: None)
    exe = ffmpeg.ffmpeg_binary()
    assert exe is not None and "imageio_ffmpeg" in exe
    return exe


@pytest.fixture(scope="module")
def source() -> np.ndarray:
    t = np.arange(int(SECONDS * RATE)) / RATE
    return (0.3 * np.sin(2 * np.pi * 220 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


@pytest.fixture(scope="module")
def clips(source: np.ndarray, tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """The source as a phone's M4A (AAC in MP4, its index at the end) and a browser's WebM (Opus), stereo M4A too."""
    exe = ffmpeg.ffmpeg_binary()  # imageio-ffmpeg is a dependency: there is always one
    assert exe is not None
    d = tmp_path_factory.mktemp("clips")
    sf.write(d / "src.wav", source, RATE)
    out = {}
    for name, args in {"m4a": ["-c:a", "aac", "-b:a", "96k"], "webm": ["-c:a", "libopus", "-b:a", "32k"],
                       "stereo.m4a": ["-ac", "2", "-c:a", "aac"]}.items():
        subprocess.run([exe, "-v", "error", "-y", "-i", str(d / "src.wav"), *args, str(d / f"clip.{name}")],
                       check=True, timeout=60)
        out[name] = (d / f"clip.{name}").read_bytes()
    return out


def _matches(decoded: np.ndarray, source: np.ndarray) -> None:
    """The same signal: about as long (AAC adds up to one frame of priming), closely correlated once aligned."""
    assert abs(decoded.size - source.size) <= 1100, (decoded.size, source.size)
    n = 20000
    lag = int(np.argmax(np.correlate(decoded[:n], source[:n], "full"))) - (n - 1)
    a, b = (decoded[lag:], source) if lag >= 0 else (decoded, source[-lag:])
    m = min(a.size, b.size)
    assert np.corrcoef(a[:m], b[:m])[0, 1] > 0.95


@pytest.mark.parametrize("which", ["system", "bundled"])
@pytest.mark.parametrize("kind", ["m4a", "webm", "stereo.m4a"])
def test_phone_and_browser_clips(which: str, kind: str, clips: dict[str, bytes], source: np.ndarray,
                                 monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if which == "system":
        assert ffmpeg.ffmpeg_binary() == system_tool("ffmpeg")
    else:
        _bundled_only(monkeypatch)
    _matches(read_audio(clips[kind], RATE, max_seconds=60), source)
    path = tmp_path / f"clip.{kind}"
    path.write_bytes(clips[kind])
    _matches(read_audio(path, RATE), source)


def test_the_limit_holds_without_decoding_everything(clips: dict[str, bytes]) -> None:
    with pytest.raises(AudioError, match="longer than the limit of 0.5 s"):
        read_audio(clips["webm"], RATE, max_seconds=0.5)


def test_without_ffmpeg_the_error_names_the_format(clips: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ffmpeg, "ffmpeg_binary", lambda: None)
    with pytest.raises(AudioError, match=r"cannot decode M4A \(MP4 audio\) audio: it needs ffmpeg"):
        read_audio(clips["m4a"], RATE)
    with pytest.raises(AudioError, match="cannot decode WebM audio: it needs ffmpeg"):
        read_audio(clips["webm"], RATE)


def test_unknown_input_never_reaches_ffmpeg(monkeypatch: pytest.MonkeyPatch) -> None:
    """A playlist (which ffmpeg would follow to local files or URLs) or any unknown bytes: refused by name."""

    def no_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("ffmpeg ran")

    monkeypatch.setattr(ffmpeg.subprocess, "run", no_run)
    for data in (b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n", b"not audio at all"):
        with pytest.raises(AudioError, match=r"unrecognised format \(first bytes "):
            read_audio(data, RATE)


def test_a_broken_clip_names_its_format(clips: dict[str, bytes]) -> None:
    broken = clips["m4a"][:40] + bytes(200)
    with pytest.raises(AudioError, match=r"cannot decode M4A \(MP4 audio\) audio: ") as e:
        read_audio(broken, RATE)
    assert "rtts-clip-" not in str(e.value)  # not the temporary file's name


@pytest.mark.parametrize("head,name", [
    (b"RIFF\0\0\0\0WAVEfmt ", "WAV"), (b"fLaC", "FLAC"), (b"OggS" + bytes(24) + b"OpusHead", "Ogg Opus"),
    (b"ID3\x04", "MP3"), (b"\xff\xfb\x90\x00", "MP3"), (b"\xff\xf1\x50\x80", "AAC (ADTS)"),
    (b"\0\0\0\x20ftypisom", "MP4/MOV (isom)"), (b"\x1a\x45\xdf\xa3\x9f\x42\x86\x81\x01webm", "WebM"),
    (b"FORM\0\0\0\0AIFF", "AIFF"), (b"caff", "CAF"), (b"#!AMR\n", "AMR"),
])
def test_sniff(head: bytes, name: str) -> None:
    found = ffmpeg.sniff(head)
    assert found is not None and found.name == name
