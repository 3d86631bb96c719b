"""The voice store never loses a voice and never stops the server (rtts.voices): every file of an entry damaged in
every way is skipped with a warning; a crash at every step of an add, an overwrite and a delete leaves the old voice
or the new one, whole; a half-done swap is recovered at start-up (a backup is restored, never deleted); a voice
added, replaced or deleted by another process (`rtts voices add` beside a running server) is seen at its next use."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import REF_TEXT, greedy, tiny_config
from liveserver import LiveServer, expect_error, session, start_msg

import rtts.voices
from rtts.__main__ import main
from rtts.voices import VoiceError, VoiceStore

CODEBOOKS = 10


def encoder(audio: bytes) -> np.ndarray:
    """Codes that identify the audio: [10, len(audio)] filled with its first byte."""
    return np.full((CODEBOOKS, len(audio)), audio[0], dtype=np.int64)


def store(root: Path) -> VoiceStore:
    return VoiceStore(root, encoder, codebooks=CODEBOOKS)


def npy(array: np.ndarray) -> bytes:
    return rtts.voices._npy_bytes(array)


def hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


# Every way a file of an entry can be damaged: (file, what is there instead; None = missing).
DAMAGE: list[tuple[str, bytes | None]] = [
    ("codes.npy", None),
    ("codes.npy", b""),
    ("codes.npy", b"\x93NUMPY garbage that is not an array"),
    ("codes.npy", b"not numpy at all"),
    ("codes.npy", npy(np.arange(12, dtype=np.int64))),  # 1-D
    ("codes.npy", npy(np.zeros((CODEBOOKS, 3), dtype=np.float32))),  # not integers
    ("codes.npy", npy(np.zeros((4, 3), dtype=np.int64))),  # another model's codebooks
    ("codes.npy", npy(np.zeros((CODEBOOKS, 0), dtype=np.int64))),  # no frames
    ("codes.npy", npy(np.array([{"a": 1}], dtype=object))),  # a pickle
    ("text.txt", None),
    ("text.txt", b""),
    ("text.txt", b"\xff\xfe not utf-8 \xc3"),
    ("meta.json", None),
    ("meta.json", b""),
    ("meta.json", b"[]"),
    ("meta.json", b"{not json"),
    ("meta.json", b'"a string"'),
    ("meta.json", b'{"created": "yesterday"}'),
    ("meta.json", b'{"tags": 5}'),
]


@pytest.mark.parametrize(("name", "content"), DAMAGE, ids=[f"{n}-{i}" for i, (n, _) in enumerate(DAMAGE)])
def test_a_damaged_entry_is_skipped_with_a_warning(tmp_path: Path, name: str, content: bytes | None,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    s = store(tmp_path)
    s.add("good", b"\x01abc", "Good words.")
    s.add("bad", b"\x02abcd", "Bad words.")
    target = tmp_path / "bad" / name
    if content is None:
        target.unlink()
    else:
        target.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="rtts.voices"):
        again = store(tmp_path)  # never fatal
    assert [v.id for v in again.list()] == ["good"]
    assert any("'bad' skipped" in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(VoiceError, match="unknown reference_id 'bad'"):
        again.get("bad")
    assert again.get("good").text == "Good words."
    assert (tmp_path / "bad").is_dir()  # left on disk for repair, never deleted
    # A running store whose copy on disk gets damaged keeps serving the copy it read, and says so once.
    caplog.clear()
    s.add("bad2", b"\x03abcde", "Third words.")
    running = store(tmp_path)
    damage = tmp_path / "bad2" / name
    if content is None:
        damage.unlink()
    else:
        damage.write_bytes(content)
    os.utime(tmp_path / "bad2", ns=(1, 1))  # (a new version of the directory, whatever the clock's resolution)
    with caplog.at_level(logging.WARNING, logger="rtts.voices"):
        assert running.get("bad2").text == "Third words."
        assert running.get("bad2").text == "Third words."
    assert sum("'bad2' skipped" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_damaged_entries_do_not_break_the_routes(golden: Path, tmp_path: Path, ref_wav: bytes) -> None:
    """A server started on a store holding damaged entries starts, lists the others (/v1/references/list, the SDK's
    /model) and serves them; then `rtts voices add` beside it adds a voice that a session uses at once, no restart."""
    voices = tmp_path / "voices"
    seed = store(voices)
    seed.add("fine", b"\x01ok", "Fine words.")
    for i, (name, content) in enumerate(DAMAGE):
        seed.add(f"bad{i}", b"\x02xyz", "Bad words.")
        if content is None:
            (voices / f"bad{i}" / name).unlink()
        else:
            (voices / f"bad{i}" / name).write_bytes(content)
    srv = LiveServer(tiny_config(golden, voices))
    try:
        with httpx.Client(base_url=srv.http, timeout=60) as h:
            r = h.get("/v1/references/list")
            assert r.status_code == 200 and r.json()["reference_ids"] == ["fine"], r.text
            r = h.get("/model", params={"page_size": 100})
            assert r.status_code == 200 and [m["_id"] for m in r.json()["items"]] == ["fine"], r.text
            for i in range(len(DAMAGE)):
                assert h.get(f"/model/bad{i}").status_code == 404
            clip = tmp_path / "clip.wav"
            clip.write_bytes(ref_wav)
            main(["voices", "add", "from-cli", str(clip), "--text", REF_TEXT, "--checkpoint",
                  str(golden / "tiny-s2"), "--voices-dir", str(voices)])
            with srv.connect() as ws:  # the running server: no restart
                audio, fin = session(ws, ["Hello."], reference_id="from-cli", **greedy(max_new_tokens=4))
                assert fin == {"event": "finish", "reason": "stop"} and audio
            assert h.get("/v1/references/list").json()["reference_ids"] == ["fine", "from-cli"]
            main(["voices", "delete", "from-cli", "--voices-dir", str(voices)])
            with srv.connect() as ws:
                ws.send(start_msg(reference_id="from-cli"))
                expect_error(ws, "unknown reference_id", "from-cli")
        srv.wait_idle()
    finally:
        srv.stop()


def test_the_cli_says_a_running_server_picks_the_voice_up(golden: Path, tmp_path: Path, encode1s_wav: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    main(["voices", "add", "v1", str(encode1s_wav), "--text", "Words.", "--checkpoint", str(golden / "tiny-s2"),
          "--voices-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert "reference_id='v1'" in err and "running `rtts serve`" in err and "no restart" in err, err


def test_another_process_s_adds_overwrites_and_deletes_are_seen(tmp_path: Path) -> None:
    """Two stores on one directory (the server, and `rtts voices add`): each sees the other's changes at its next
    lookup, and lists them."""
    server, cli = store(tmp_path), store(tmp_path)
    with pytest.raises(VoiceError, match="unknown"):
        server.get("x")
    cli.add("x", b"\x05first", "First.")
    assert server.get("x").text == "First." and [v.id for v in server.list()] == ["x"]
    first = server.get("x").created
    cli.add("x", b"\x06second!", "Second.")
    v = server.get("x")
    assert v.text == "Second." and v.created > first and v.codes[0, 0] == 6
    cli.update("x", title="Retitled")
    assert server.get("x").meta.title == "Retitled"
    assert cli.delete("x")
    with pytest.raises(VoiceError, match="unknown"):
        server.get("x")
    assert server.list() == [] and not server.delete("x")


# ------------------------------------------------------------------------------------------ crashes mid-write


class Crash(BaseException):
    """The process died here: nothing after it runs (not even `finally` cleanups that touch the disk)."""


class CrashAt:
    """Counts the store's disk steps (file writes, fsyncs, renames, removals) and dies at step `at`."""

    def __init__(self, at: int) -> None:
        self.at, self.steps, self.dead = at, 0, False

    def wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def step(*args: Any, **kw: Any) -> Any:
            if self.dead:
                raise Crash(f"after death: {name}")
            if self.steps == self.at:
                self.dead = True
                if name == "write":  # a torn write: half the bytes reached the file
                    path, data = args
                    Path(path).write_bytes(data[: len(data) // 2])
                raise Crash(f"died at step {self.at}: {name}")
            self.steps += 1
            return real(*args, **kw)

        return step


def with_crash(monkeypatch: pytest.MonkeyPatch, at: int, action: Callable[[], object]) -> bool:
    """Run `action` with a crash at disk step `at`; True if it completed (there were fewer steps)."""
    crash = CrashAt(at)
    monkeypatch.setattr(rtts.voices, "_write_durably", crash.wrap("write", rtts.voices._write_durably))
    monkeypatch.setattr(rtts.voices, "_fsync_dir", crash.wrap("fsync", rtts.voices._fsync_dir))
    monkeypatch.setattr(rtts.voices.os, "rename", crash.wrap("rename", os.rename))
    monkeypatch.setattr(rtts.voices.os, "replace", crash.wrap("replace", os.replace))
    monkeypatch.setattr(rtts.voices.shutil, "rmtree", crash.wrap("rmtree", shutil.rmtree))
    try:
        action()
        return True
    except Crash:
        return False
    finally:
        monkeypatch.undo()


OLD, NEW = (b"\x07old clip", "The old words."), (b"\x08the new clip", "The new words.")


def is_whole(voice: Any, clip: tuple[bytes, str]) -> bool:
    """The voice is exactly the one stored from `clip`: its transcript and all its codes."""
    return bool(voice.text == clip[1] and np.array_equal(voice.codes, encoder(clip[0])))


@pytest.mark.parametrize("operation", ["overwrite", "add", "delete", "update"])
def test_a_crash_at_every_step_leaves_the_old_or_the_new(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         operation: str) -> None:
    """For every step k of the operation: die there, start a fresh store on the directory (start-up recovery), and
    find the voice whole as before or as after, never missing or damaged, with nothing hidden left over."""
    for at in range(100):
        root = tmp_path / f"{operation}-{at}"
        before = store(root)
        if operation != "add":
            before.add("v", *OLD)
        act: dict[str, Callable[[], object]] = {
            "overwrite": lambda: before.add("v", *NEW),
            "add": lambda: before.add("v", *NEW),
            "delete": lambda: before.delete("v"),
            "update": lambda: before.update("v", title="New title"),
        }
        completed = with_crash(monkeypatch, at, act[operation])
        after = store(root)
        assert hidden(root) == [], (at, hidden(root))
        voices = after.list()
        if operation == "add":
            assert voices == [] or (len(voices) == 1 and is_whole(voices[0], NEW)), (at, voices)
        elif operation == "delete":
            assert voices == [] or (len(voices) == 1 and is_whole(voices[0], OLD)), (at, voices)
        else:
            assert len(voices) == 1, (at, voices)
            assert is_whole(voices[0], OLD) or (operation == "overwrite" and is_whole(voices[0], NEW)), at
            assert voices[0].meta.title in ("", "New title")
        if completed:  # every step was crossed: the result is the new state
            if operation in ("overwrite", "add"):
                assert is_whole(after.get("v"), NEW)
            elif operation == "delete":
                assert voices == []
            else:
                assert after.get("v").meta.title == "New title"
            assert at >= 3  # there were steps to crash at
            return
    raise AssertionError("the operation never completed")


def test_start_up_restores_a_backup_without_its_voice(tmp_path: Path) -> None:
    """A swap interrupted between its two renames leaves `.<id>.<x>.old` and no `<id>`: start-up restores it (never
    deletes it). With its voice beside it (interrupted after the second rename), the backup goes."""
    s = store(tmp_path)
    s.add("kept", *OLD)
    s.add("newer", *NEW)
    os.rename(tmp_path / "kept", tmp_path / ".kept.abc123.old")
    shutil.copytree(tmp_path / "newer", tmp_path / ".newer.def456.old")
    (tmp_path / ".newer.ghi789.tmp").mkdir()  # a write that never swapped in
    again = store(tmp_path)
    assert is_whole(again.get("kept"), OLD) and is_whole(again.get("newer"), NEW)
    assert hidden(tmp_path) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["kept", "newer"]
    meta = json.loads((tmp_path / "kept" / "meta.json").read_text())
    assert meta["frames"] == len(OLD[0])
