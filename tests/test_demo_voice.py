"""The demo voice packaged with rtts (`rtts/demo_voice/`) is what `rtts serve` and `rtts synth` use without
`--checkpoint`: the default resolves to the packaged folder and loads through the ordinary loaders, a live session on it
streams speech-like audio (neither near-silent nor noise) and ends by itself, what the log, `/v1/info` and the demo page
say about it comes from the folder's README, and the folder stays small enough to ship in the package."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile as sf
from conftest import system_tool
from liveserver import LiveServer, free_port, session

import rtts
import rtts.ws.server
from rtts.__main__ import main
from rtts.runtime import Runtime, ServerConfig
from rtts.tools import demo_voice
from rtts.tools.demo_voice import demo_voice_dir, summary
from rtts.train.export import MAX_BYTES

TEXT = "Hello there, how are you today?"
MAX_FRAMES = 250  # a cap far above this sentence's length: a session that reaches it did not end by itself


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def server_log() -> Iterator[Records]:
    records = Records()
    logger = logging.getLogger("rtts.server")
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    yield records
    logger.removeHandler(records)
    logger.setLevel(level)


@pytest.fixture(scope="module")
def default_srv(server_log: Records, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server built as `rtts serve` builds it without --checkpoint (no preloaded model: the runtime loads its
    default itself)."""
    config = ServerConfig(port=free_port(), max_running=2, max_ctx=1024, warmup=False,
                          voices_dir=str(tmp_path_factory.mktemp("voices")))
    assert config.checkpoint is None
    srv = LiveServer(config, Runtime(config))
    yield srv
    srv.stop()


def speech_like(pcm: bytes, rate: int) -> tuple[bool, str]:
    """Whether 16-bit PCM sounds like speech rather than silence or noise: audible but not near full scale, a peaky
    (harmonic) spectrum where noise is flat, and loudness that rises and falls from syllable to pause (20 ms frames)."""
    x = np.frombuffer(pcm, "<i2").astype(np.float64) / 32768.0
    rms_db = 20 * np.log10(max(float(np.sqrt(np.mean(x**2))), 1e-12))
    clipped = float(np.mean(np.abs(x) > 0.99))
    n = 512
    frames = x[: x.size // n * n].reshape(-1, n) * np.hanning(n)
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2 + 1e-12
    energy = np.sqrt(np.mean(frames**2, axis=1))
    loud = energy > 0.1 * energy.max()
    flatness = float(np.median(np.exp(np.mean(np.log(power[loud]), axis=1)) / np.mean(power[loud], axis=1)))
    hop = rate // 50
    levels = 20 * np.log10(np.sqrt(np.mean(x[: x.size // hop * hop].reshape(-1, hop) ** 2, axis=1)) + 1e-9)
    spread = float(np.std(levels))
    facts = f"rms {rms_db:.1f} dBFS, clipped {clipped:.3f}, flatness {flatness:.3f}, level spread {spread:.1f} dB"
    ok = -45.0 < rms_db < -6.0 and clipped < 0.01 and flatness < 0.1 and spread > 8.0
    return ok, facts


def test_speech_check_refuses_silence_and_noise() -> None:
    """The check the live test relies on fails on what a broken model makes."""
    rng = np.random.default_rng(0)
    rate = 16000

    def pcm(x: np.ndarray) -> bytes:
        return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()

    assert not speech_like(pcm(0.1 * rng.standard_normal(2 * rate)), rate)[0]  # noise at a speech-like level
    assert not speech_like(pcm(rng.uniform(-1, 1, 2 * rate)), rate)[0]  # full-scale noise
    assert not speech_like(pcm(1e-4 * rng.standard_normal(2 * rate)), rate)[0]  # near silence


def test_default_is_the_packaged_folder(default_srv: LiveServer) -> None:
    """The runtime without a checkpoint loads the folder inside the installed package through load_model/load_codec,
    like any --checkpoint (the same codec config, the same model files), and says so."""
    d = demo_voice_dir()
    assert d == Path(rtts.__file__).resolve().parent / "demo_voice" and d.is_dir()
    rt = default_srv.rt
    assert rt.default_model and rt.checkpoint is None
    assert rt.loaded.checkpoint_dir == d
    codec_config = json.loads((d / "codec_config.json").read_text())
    assert rt.sample_rate == codec_config["sample_rate"]
    assert rt.loaded.config.model_type == json.loads((d / "config.json").read_text())["model_type"]


def test_serve_and_synth_default_to_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """`rtts serve` with no --checkpoint hands the runtime no checkpoint (the runtime's default is the packaged voice:
    above); voices stay under $RTTS_HOME/voices. `rtts synth` speaks with the packaged voice at its codec's rate, and
    nothing is written under $RTTS_HOME."""
    home = tmp_path / "home"
    monkeypatch.setenv("RTTS_HOME", str(home))
    seen: list[ServerConfig] = []
    monkeypatch.setattr(rtts.ws.server, "serve", lambda config, rt=None: seen.append(config))
    main(["serve", "--port", "0"])
    assert seen[0].checkpoint is None and seen[0].voices_dir == str(home / "voices")

    out = tmp_path / "o.wav"
    main(["synth", TEXT, "--seed", "1", "--max-frames", "8", "-o", str(out)])
    assert str(demo_voice_dir()) in capsys.readouterr().err
    audio, rate = sf.read(out)
    assert rate == json.loads((demo_voice_dir() / "codec_config.json").read_text())["sample_rate"] and audio.size > 0
    assert not home.exists()


def test_live_session_speaks(default_srv: LiveServer) -> None:
    """A short live session on the default model: audio that sounds like speech (not near-silent, not noise), which
    ends before the frame cap (the model stopped by itself), and a normal finish."""
    rate = default_srv.rt.sample_rate
    with default_srv.connect() as ws:
        pcm, fin = session(ws, [TEXT], sample_rate=rate, seed=0, max_new_tokens=MAX_FRAMES)
    assert fin == {"event": "finish", "reason": "stop"}, fin
    cc = default_srv.rt.codec.config
    seconds = len(pcm) / 2 / rate
    assert 0.5 < seconds < 0.9 * MAX_FRAMES * cc.frame_length / cc.sample_rate, seconds
    ok, facts = speech_like(pcm, rate)
    assert ok, facts
    default_srv.wait_idle()


def test_what_is_served_is_said(default_srv: LiveServer, server_log: Records) -> None:
    """The startup log, /v1/info (which the demo page shows) and /v1/health name the default voice; the words come
    from the folder's README."""
    about = summary(demo_voice_dir())
    assert about
    info = httpx.get(default_srv.http + "/v1/info").json()
    assert info["default_model"] is True and info["note"] == f"embedded demo voice: {about}"
    assert httpx.get(default_srv.http + "/v1/health").json()["default_model"] is True
    served = [m for m in server_log.messages if m.startswith("serving the embedded demo voice")]
    assert len(served) == 1 and str(demo_voice_dir()) in served[0] and about in served[0], server_log.messages


def test_demo_page_names_the_default_voice(default_srv: LiveServer) -> None:
    """The browser demo shows the server's note about its default voice (the system's Chromium, headless)."""
    sync_api = pytest.importorskip("playwright.sync_api")
    exe = system_tool("chromium")
    note = httpx.get(default_srv.http + "/v1/info").json()["note"]
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=exe, headless=True,
                                    args=["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"])
        try:
            page = browser.new_page()
            page.goto(default_srv.http + "/")
            about = page.locator("#about")
            about.wait_for(state="visible", timeout=60_000)
            assert note in about.inner_text() and "--checkpoint" in about.inner_text()
        finally:
            browser.close()


def test_summary_reads_the_readme(tmp_path: Path) -> None:
    """The first paragraph after the title, on one line, without asides in parentheses or code marks."""
    (tmp_path / "README.md").write_text("# a voice\n\nA voice (`x.py`, see\nthere) for `tests`.\nIt speaks.\n\n"
                                        "Format: more.\n")
    assert summary(tmp_path) == "A voice for tests. It speaks."
    assert summary(tmp_path / "missing") == ""


def test_incomplete_install_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.setattr(demo_voice, "DEMO_VOICE_DIR", tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["synth", TEXT, "-o", str(tmp_path / "o.wav")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "demo voice is incomplete" in err and "model.safetensors" in err and "--checkpoint" in err


def test_folder_fits_the_package() -> None:
    """Everything in the folder ships inside the wheel: it stays within the size export allows."""
    files = [f for f in demo_voice_dir().iterdir() if f.is_file()]
    assert {"README.md", *demo_voice.REQUIRED_FILES} <= {f.name for f in files}
    total = sum(f.stat().st_size for f in files)
    assert total <= MAX_BYTES, total
