"""Starting and stopping the server: graceful shutdown with a session streaming, the garbage-collector freeze and the
prefill batch size the runtime is built with, and what `rtts serve` passes it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import websockets
from conftest import LONG_TEXT, tiny_config
from liveserver import FLUSH, LiveServer, recv_event, start_msg, text_msg, until_finish

from rtts.__main__ import main as rtts_main
from rtts.engine.engine import DEFAULT_PREFILL_ROWS
from rtts.runtime import ServerConfig


def test_graceful_shutdown(golden: Path, tmp_path: Path) -> None:
    """Server stopping with a session streaming: the client gets finish/error + message, then a close; nothing hangs."""
    s = LiveServer(tiny_config(golden, tmp_path))
    stopped = False
    try:
        with s.connect() as ws, s.connect() as idle:
            ws.send(start_msg(sample_rate=8000, max_new_tokens=200))
            ws.send(text_msg(LONG_TEXT))
            ws.send(FLUSH)
            assert recv_event(ws)["event"] == "audio"
            t = time.monotonic()
            s.server.should_exit = True
            events, fin = until_finish(ws, timeout=15)
            assert fin["reason"] == "error" and "shutting down" in fin["message"], fin
            with pytest.raises(websockets.exceptions.ConnectionClosed):
                while True:
                    recv_event(ws, 15)
            with pytest.raises(websockets.exceptions.ConnectionClosed):  # a socket without a session just closes
                recv_event(idle, 15)
            s.thread.join(30)
            stopped = not s.thread.is_alive()
            assert stopped, "the server did not stop"
            assert time.monotonic() - t < 15
    finally:
        if not stopped:
            s.stop()


def test_runtime_freezes_startup_objects_for_the_garbage_collector(golden: Path, tmp_path: Path) -> None:
    """With freeze_gc (what `rtts serve` sets), everything alive after start-up leaves the cyclic collector's view,
    so a full collection while serving no longer walks the model, modules and graphs with every thread stopped."""
    import gc

    from rtts.runtime import Runtime

    rt = Runtime(tiny_config(golden, tmp_path, warmup=False, freeze_gc=True))
    try:
        rt.start()
        assert gc.get_freeze_count() > 10_000  # modules, torch, the model: far more than a handful of objects
        assert rt.ready
    finally:
        rt.stop()
        gc.unfreeze()  # give the test process its collector back


def test_runtime_batches_prompts_as_configured(golden: Path, tmp_path: Path) -> None:
    from rtts.runtime import Runtime

    rt = Runtime(tiny_config(golden, tmp_path, warmup=False, prefill_rows=3))
    assert rt.engine.prefill_rows == 3 and rt.engine.fast_kv_prefill.k.shape[1] == 3


def test_rtts_serve_freezes_the_garbage_collector(golden: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import rtts.ws.server

    seen: list[ServerConfig] = []
    monkeypatch.setattr(rtts.ws.server, "serve", lambda config, rt=None: seen.append(config))
    for name in ("RTTS_CODEC_GRAPHS", "RTTS_PREFILL_GRAPHS", "RTTS_CODEC_TF32"):  # the defaults, whatever the shell
        monkeypatch.delenv(name, raising=False)
    rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0"])
    assert len(seen) == 1 and seen[0].freeze_gc and seen[0].codec_graphs and seen[0].prefill_graphs
    assert seen[0].codec_tf32
    rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0", "--no-codec-graphs",
               "--no-prefill-graphs", "--no-codec-tf32"])
    assert not seen[1].codec_graphs and not seen[1].prefill_graphs and not seen[1].codec_tf32
    monkeypatch.setenv("RTTS_CODEC_GRAPHS", "0")
    monkeypatch.setenv("RTTS_PREFILL_GRAPHS", "off")
    monkeypatch.setenv("RTTS_CODEC_TF32", "no")
    rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0"])
    assert not seen[2].codec_graphs and not seen[2].prefill_graphs and not seen[2].codec_tf32
    rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0", "--codec-tf32"])  # the flag wins
    assert seen[3].codec_tf32 and not seen[3].codec_graphs
    assert seen[3].prefill_rows == DEFAULT_PREFILL_ROWS == 16
    rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0", "--prefill-rows", "5"])
    assert seen[4].prefill_rows == 5
    with pytest.raises(SystemExit):  # the CLI prints the ValueError's message and exits 2
        rtts_main(["serve", "--checkpoint", str(golden / "tiny-s2"), "--port", "0", "--prefill-rows", "0"])
    assert len(seen) == 5
