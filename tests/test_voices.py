"""Stored voices (rtts.voices) and reference-audio decoding limits, without a model: the encoder is a stub."""

from __future__ import annotations

import io
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from rtts.audio.io import AudioError, read_audio
from rtts.voices import VoiceError, VoiceStore


def fake_encoder(audio: bytes) -> np.ndarray:
    return np.full((10, 4), len(audio) % 7, dtype=np.int64)


def wav(seconds: float, rate: int = 8000, channels: int = 1, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, np.zeros((int(seconds * rate), channels), np.float32), rate, format=fmt)
    return buf.getvalue()


def test_over_long_reference_is_refused_from_its_header(monkeypatch: pytest.MonkeyPatch) -> None:
    """A small compressed file can claim minutes of audio: the limit is checked before anything is decoded."""
    data = wav(120, fmt="FLAC")
    assert len(data) < 200_000  # compressed silence

    def no_decode(*a: object, **k: object) -> None:
        raise AssertionError("decoded before the length check")

    monkeypatch.setattr(sf, "read", no_decode)
    with pytest.raises(AudioError, match="120.0 s long, the limit is 60 s"):
        read_audio(data, 44100, max_seconds=60)
    monkeypatch.undo()
    with pytest.raises(AudioError, match="9 channels"):
        read_audio(wav(0.5, channels=9), 44100, max_seconds=60)
    assert read_audio(wav(0.5, channels=2), 44100, max_seconds=60).size == 22050


def test_voice_ids_are_whole_matches(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path, fake_encoder)
    for bad in ("nl\n", "../x", "a/b", ".hidden", "", "x" * 129):
        with pytest.raises(VoiceError, match="invalid voice id"):
            store.add(bad, wav(0.1), "text")
    store.add("ok-1.v_2", wav(0.1), "text")
    assert [v.id for v in store.list()] == ["ok-1.v_2"]


def test_concurrent_adds_of_one_id_keep_one_whole_voice(tmp_path: Path) -> None:
    """Writers of the same id each use their own scratch directory; the last one wins on disk and in memory."""
    store = VoiceStore(tmp_path, fake_encoder)
    errors: list[BaseException] = []

    def add(i: int) -> None:
        try:
            store.add("race", wav(0.1 + i / 1000), f"take {i}")
        except BaseException as e:  # noqa: BLE001 - collected for the assertion below
            errors.append(e)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(p.name for p in tmp_path.iterdir()) == ["race"]  # no scratch directory left behind
    again = VoiceStore(tmp_path, fake_encoder)
    assert again.get("race").text == store.get("race").text


def test_a_crashed_add_is_not_loaded_as_a_voice(tmp_path: Path) -> None:
    store = VoiceStore(tmp_path, fake_encoder)
    store.add("kept", wav(0.1), "text")
    left = tmp_path / ".zz.abc123.tmp"  # what a crash between writing and renaming leaves
    left.mkdir()
    for name in ("codes.npy", "text.txt", "meta.json"):
        (left / name).write_bytes((tmp_path / "kept" / name).read_bytes())
    again = VoiceStore(tmp_path, fake_encoder)
    assert [v.id for v in again.list()] == ["kept"]
    assert not left.exists()


def test_voice_from_several_clips_joins_them_in_order(tmp_path: Path) -> None:
    """One voice from several clips: their codes and transcripts in the given order, each clip kept on disk."""
    codes = {b"a": np.full((10, 3), 1, np.int64), b"bb": np.full((10, 5), 2, np.int64)}
    store = VoiceStore(tmp_path, lambda audio: codes[audio])
    v = store.add_samples("two", [(b"a", "First clip."), (b"bb", " Second clip. ")])
    assert v.text == "First clip. Second clip." and v.codes.shape == (10, 8)
    assert (v.codes[:, :3] == 1).all() and (v.codes[:, 3:] == 2).all()
    assert sorted(p.name for p in (tmp_path / "two").glob("audio*")) == ["audio.0.bin", "audio.1.bin"]
    again = VoiceStore(tmp_path, fake_encoder).get("two")
    assert again.text == v.text and np.array_equal(again.codes, v.codes)
    with pytest.raises(VoiceError, match="empty"):
        store.add_samples("bad", [(b"a", "ok"), (b"bb", "  ")])
    with pytest.raises(VoiceError, match="no reference audio"):
        store.add_samples("none", [])


def test_voice_metadata_updates_persist_and_keep_the_sound(tmp_path: Path) -> None:
    """Title, description, tags and visibility are stored with the voice, survive a restart, and an update changes
    only them (not the codes, not `created`, which keys the sessions' prefill cache)."""
    from rtts.voices import VoiceMeta

    store = VoiceStore(tmp_path, fake_encoder)
    v = store.add("m", b"abc", "Text.", VoiceMeta("Title", "About it.", ("en", "calm"), "unlist"))
    u = store.update("m", title="New title", tags=("en",))
    assert (u.meta.title, u.meta.description, u.meta.tags, u.meta.visibility) == ("New title", "About it.", ("en",),
                                                                                  "unlist")
    assert u.created == v.created and u.updated >= v.created and np.array_equal(u.codes, v.codes)
    loaded = VoiceStore(tmp_path, fake_encoder).get("m")
    assert loaded.meta == u.meta and loaded.created == v.created and loaded.updated == u.updated
    with pytest.raises(VoiceError, match="visibility"):
        store.update("m", visibility="everyone")
    assert store.get("m").meta == u.meta  # a refused update changes nothing
    with pytest.raises(VoiceError, match="unknown"):
        store.update("nobody", title="x")
    with pytest.raises(VoiceError, match="visibility"):
        store.add("v2", b"abc", "Text.", VoiceMeta(visibility="secret"))
