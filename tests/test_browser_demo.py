"""The browser demo (`/`, clients/web) in a real browser: the system's Chromium driven by Playwright, against a real
server on the tiny golden checkpoint. Speak, the first-audio time, the counters, the waveform and the WAV download;
Speak again and Cancel; a failed run's counters; the stored voices; cloning from an uploaded clip (WebM, as browsers
record) and from the microphone (Chromium's fake capture device, recorded by MediaRecorder). A screenshot of the page
after a run is kept in the test's temporary directory."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import soundfile as sf
from conftest import REF_TEXT, system_tool
from liveserver import LiveServer

from rtts.audio import ffmpeg

playwright = pytest.importorskip("playwright.sync_api")

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 # the microphone: granted without asking, a synthetic capture device
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 "--autoplay-policy=no-user-gesture-required"]
WAIT_MS = 90_000  # for a run to end: generous on a loaded machine, yet a hang fails the test
SHORT = "This is a test of the plugin."  # the tiny checkpoint ends this one after about 28 frames
LONG = " ".join(f"Sentence number {i} keeps the model busy for a while." for i in range(12))


@pytest.fixture(scope="module")
def browser() -> Iterator[playwright.Browser]:
    exe = system_tool("chromium")
    with playwright.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


class Page:
    """One tab on the demo, recording what would show in its console: errors, failed requests."""

    def __init__(self, browser: playwright.Browser, srv: LiveServer) -> None:
        self.context = browser.new_context(accept_downloads=True, viewport={"width": 860, "height": 1000})
        self.page = self.context.new_page()
        self.problems: list[str] = []
        self.page.on("pageerror", lambda e: self.problems.append(f"page error: {e}"))
        self.page.on("console", lambda m: self.problems.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.on("response", lambda r: self.problems.append(f"{r.status} {r.url}") if r.status >= 400 else None)
        self.page.goto(srv.http + "/")
        self.page.wait_for_function("document.getElementById('voice').dataset.loaded !== undefined")

    def text(self, sel: str) -> str:
        return self.page.locator(sel).inner_text()

    def speak(self, text: str) -> None:
        self.page.fill("#text", text)
        self.page.click("#speak")

    def wait_status(self, pattern: str) -> str:
        self.page.wait_for_function(f"/{pattern}/.test(document.getElementById('status').textContent)",
                                    timeout=WAIT_MS)
        return self.text("#status")

    def close(self) -> None:
        self.context.close()


@pytest.fixture
def tab(browser: playwright.Browser, srv: LiveServer) -> Iterator[Page]:
    t = Page(browser, srv)
    yield t
    t.close()
    assert not t.problems, t.problems
    srv.wait_idle()


def test_speak_download_speak_again_and_cancel(tab: Page, srv: LiveServer, tmp_path: Path) -> None:
    page = tab.page
    assert page.title() == "rtts demo"
    assert httpx.get(srv.http + "/favicon.ico").headers["content-type"] == "image/x-icon"
    tab.speak(SHORT)
    assert tab.wait_status("finished|error") == "finished"
    chunks, seconds = int(tab.text("#chunks")), float(tab.text("#dur").split()[0])
    assert chunks > 0 and seconds > 0
    assert re.fullmatch(r"\d+ ms", tab.text("#ttfa"))
    # the waveform of what arrived is drawn
    drawn = page.evaluate("""() => { const c = document.getElementById('wave');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }""")
    assert drawn > 100
    page.screenshot(path=str(tmp_path / "demo.png"), full_page=True)
    assert (tmp_path / "demo.png").stat().st_size > 10_000
    # what was spoken, as a WAV: every sample the counters counted
    with page.expect_download() as d:
        page.click("#download")
    data, rate = sf.read(d.value.path(), dtype="int16")
    assert rate == 24000 and abs(data.size - seconds * 24000) <= 120  # (the page shows seconds to 2 decimals)
    # Speak again, and cancel once audio flows
    tab.speak(LONG)
    page.wait_for_function("Number(document.getElementById('chunks').textContent) > 0", timeout=WAIT_MS)
    page.click("#cancel")
    assert tab.wait_status("cancelled|finished|error") == "cancelled"
    assert page.locator("#cancel").is_disabled()


def test_a_failed_run_shows_its_own_counts(tab: Page, srv: LiveServer, ref_wav: bytes) -> None:
    """A run that fails starts from zero: the last run's first-audio time and counts do not stay on screen."""
    r = httpx.post(srv.http + "/v1/references/add", files={"audio": ("a.wav", ref_wav, "audio/wav")},
                   data={"id": "soon-gone", "text": REF_TEXT})
    assert r.status_code == 200, r.text
    page = tab.page
    page.click("#refresh")
    page.wait_for_function("[...document.getElementById('voice').options].some(o => o.value === 'soon-gone')")
    tab.speak(SHORT)
    assert tab.wait_status("finished|error") == "finished" and int(tab.text("#chunks")) > 0
    page.select_option("#voice", "soon-gone")
    assert httpx.delete(srv.http + "/v1/references/delete", params={"id": "soon-gone"}).status_code == 200
    tab.speak(SHORT)
    assert "unknown reference_id" in tab.wait_status("finished|error")
    assert (tab.text("#ttfa"), tab.text("#chunks"), tab.text("#dur")) == ("–", "0", "0.00 s")
    assert page.locator("#download").is_hidden()


@pytest.fixture(scope="module")
def webm_clip(tmp_path_factory: pytest.TempPathFactory, golden: Path) -> Path:
    """The reference clip as a browser would record it: WebM with Opus."""
    from liveserver import reference_wav

    d = tmp_path_factory.mktemp("clip")
    (d / "ref.wav").write_bytes(reference_wav(golden, seconds=2.0))
    exe = ffmpeg.ffmpeg_binary()
    assert exe is not None
    subprocess.run([exe, "-v", "error", "-y", "-i", str(d / "ref.wav"), "-c:a", "libopus", str(d / "ref.webm")],
                   check=True, timeout=60)
    return d / "ref.webm"


def _clone(tab: Page, voice_id: str, speak: bool) -> None:
    page = tab.page
    page.fill("#clone-id", voice_id)
    page.fill("#clone-text", REF_TEXT)
    page.click("#clone")
    page.wait_for_function("/saved|error|HTTP|failed|no /.test(document.getElementById('clone-status').textContent)",
                           timeout=WAIT_MS)
    assert tab.text("#clone-status") == f"saved voice {voice_id}"
    page.wait_for_function(f"document.getElementById('voice').value === '{voice_id}'")  # the list has it, picked
    if not speak:
        return
    tab.speak(SHORT)
    assert tab.wait_status("finished|error") == "finished"
    assert int(tab.text("#chunks")) > 0


def test_clone_from_an_uploaded_clip(tab: Page, srv: LiveServer, webm_clip: Path) -> None:
    tab.page.set_input_files("#clone-file", str(webm_clip))
    _clone(tab, "uploaded", speak=True)
    listed = httpx.get(srv.http + "/v1/references/list").json()["reference_ids"]
    assert "uploaded" in listed


def test_clone_from_the_microphone(tab: Page, srv: LiveServer) -> None:
    page = tab.page
    page.click("#record")
    page.wait_for_function("parseFloat((document.getElementById('rec-time').textContent.match(/[\\d.]+/) || [0])[0])"
                           " >= 1.5", timeout=WAIT_MS)
    page.click("#stop-record")
    page.wait_for_function("document.getElementById('rec-time').textContent.startsWith('recorded')")
    assert "webm" in tab.text("#rec-time")
    _clone(tab, "recorded", speak=False)  # (a cloned voice speaks: the upload test)
    voice = srv.rt.voices.get("recorded")
    assert voice.codes.shape[1] > 0 and voice.text == REF_TEXT
