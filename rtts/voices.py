"""Voices: stored references (`reference_id`) persisted on disk, and inline references cached by content hash.

A voice is a transcript plus codec codes [num_codebooks, frames]; audio is encoded once (when added, or the first
time an inline reference is seen) and never again. Stored voices live in `<voices_dir>/<id>/` as `codes.npy`,
`text.txt` and `meta.json` (creation time, and the SDK's voice metadata: title, description, tags, visibility, last
update); the original audio is kept beside them as `audio.bin` (`audio.<i>.bin` per sample of a voice added from
several clips) for re-encoding with another codec.

The store never loses a voice and never stops the server:

- A write (add, overwrite) goes to a hidden directory `.<id>.<random>.tmp`, every file and the directory fsynced,
  then swaps in: the old copy is renamed to `.<id>.<random>.old`, the new one to `<id>`, the backup deleted. At every
  instant the old copy or the new one is whole on disk under one of those names. A delete renames `<id>` to
  `.<id>.<random>.del` before removing it. Writers of one directory (threads, and other processes such as
  `rtts voices add` beside a running server) take turns on an exclusive lock (flock of `<voices_dir>` itself).
- At start-up, under that lock, a half-done swap is finished: a backup whose voice has no directory is restored
  (never deleted), one beside its voice is removed, as are temporary and deleted directories.
- An entry that does not read back whole (a missing, empty or garbage file, codes that are not a 2-D integer array
  of the model's codebooks, meta.json that is not an object) is skipped with a warning, left on disk for repair.
- The disk is the truth: a voice another process added, overwrote or deleted is seen at its next use (each lookup
  compares the directory's identity with the copy in memory and reads the disk through on a difference), so
  `rtts voices add` needs no server restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rtts import env
from rtts.audio.io import AudioError, read_audio
from rtts.model.codec import Codec, encode_audio

log = logging.getLogger("rtts.voices")

VOICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # whole id (fullmatch: "$" would admit a final newline)


def default_voices_dir() -> Path:
    """The store `rtts serve` and `rtts voices` use without --voices-dir: $RTTS_HOME/voices (~/.cache/rtts/voices)."""
    return Path(env.home() or Path.home() / ".cache" / "rtts") / "voices"


class VoiceError(ValueError):
    """A bad voice id, an unknown voice, or reference audio that cannot be used."""


VISIBILITIES = ("public", "unlist", "private")


@dataclass(frozen=True)
class VoiceMeta:
    """What the SDK's voice management (`/model`) shows and edits; the voice's sound does not depend on it."""

    title: str = ""
    description: str = ""
    tags: tuple[str, ...] = ()
    visibility: str = "private"

    def checked(self) -> VoiceMeta:
        if self.visibility not in VISIBILITIES:
            raise VoiceError(f"visibility must be one of {', '.join(VISIBILITIES)}, got {self.visibility!r}")
        return self


@dataclass(frozen=True)
class Voice:
    id: str
    text: str
    codes: np.ndarray  # [num_codebooks, frames] int64
    created: float = 0.0
    meta: VoiceMeta = VoiceMeta()
    updated: float = 0.0  # the last metadata change (created, until one)

    def info(self) -> dict[str, object]:
        return {"id": self.id, "text": self.text, "frames": int(self.codes.shape[1]), "created": self.created}

    def _meta_json(self) -> str:
        m = self.meta
        return json.dumps({"created": self.created, "frames": int(self.codes.shape[1]), "title": m.title,
                           "description": m.description, "tags": list(m.tags), "visibility": m.visibility,
                           "updated": self.updated})


Encoder = Callable[[bytes], np.ndarray]  # audio file bytes -> codes [num_codebooks, frames]


def reference_encoder(codec: Codec, max_seconds: float, name: str = "") -> Encoder:
    """The encoder of a store served with `codec` (the server's, and `rtts voices add`'s): reference audio bytes ->
    codes [num_codebooks, frames] on the caller's thread, clips over `max_seconds` refused. Audio it cannot use is
    a VoiceError, naming `name` (a file) when given."""

    def encode(audio: bytes) -> np.ndarray:
        try:
            pcm = read_audio(audio, codec.config.sample_rate, max_seconds)
        except AudioError as e:
            message = str(e).replace("audio bytes: ", "")
            raise VoiceError(f"{name}: {message}" if name else message) from None
        return encode_audio(codec, pcm).numpy()

    return encode


class DamagedVoice(Exception):
    """A stored voice's directory does not read back whole (the message says which file and how)."""


Signature = tuple[int, int]  # a voice directory's (inode, mtime in ns): it changes with every swap or update


def _signature(d: Path) -> Signature | None:
    try:
        st = os.stat(d)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns)


def read_voice(d: Path, codebooks: int | None = None) -> Voice:
    """The voice stored in directory `d`, checked whole; DamagedVoice names what is wrong."""
    try:
        text = (d / "text.txt").read_text(encoding="utf-8")
        meta = json.loads((d / "meta.json").read_text(encoding="utf-8"))
        codes = np.load(d / "codes.npy", allow_pickle=False)
    except FileNotFoundError as e:
        raise DamagedVoice(f"{Path(e.filename or '').name or 'a file'} is missing") from None
    except (OSError, ValueError, EOFError, UnicodeDecodeError) as e:  # (json's error is a ValueError)
        raise DamagedVoice(f"unreadable file: {type(e).__name__}: {e}") from None
    if not text.strip():
        raise DamagedVoice("text.txt is empty")
    if not isinstance(codes, np.ndarray) or codes.ndim != 2 or not np.issubdtype(codes.dtype, np.integer):
        raise DamagedVoice(f"codes.npy must be a 2-D integer array, got {getattr(codes, 'shape', '?')} "
                           f"{getattr(codes, 'dtype', '?')}")
    if codes.shape[1] == 0 or (codebooks is not None and codes.shape[0] != codebooks):
        raise DamagedVoice(f"codes.npy has shape {list(codes.shape)}, expected [{codebooks or 'codebooks'}, frames>0]")
    if not isinstance(meta, dict):
        raise DamagedVoice(f"meta.json must hold an object, got {type(meta).__name__}")
    try:
        created = float(meta.get("created", 0))
        tags = meta.get("tags", [])
        if not isinstance(tags, list):
            raise TypeError("tags is not a list")
        vm = VoiceMeta(str(meta.get("title", "")), str(meta.get("description", "")), tuple(str(t) for t in tags),
                       str(meta.get("visibility", "private")))
        updated = float(meta.get("updated", created))
    except (TypeError, ValueError) as e:
        raise DamagedVoice(f"meta.json: {e}") from None
    return Voice(d.name, text, np.ascontiguousarray(codes, dtype=np.int64), created, vm, updated)


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _npy_bytes(codes: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, codes)
    return buf.getvalue()


def _hidden(name: str) -> tuple[str, str] | None:
    """(voice id, kind) of a store's hidden directory `.<id>.<random>.<kind>`, else None."""
    if not name.startswith("."):
        return None
    parts = name[1:].rsplit(".", 2)
    if len(parts) != 3 or parts[2] not in ("tmp", "old", "del") or not VOICE_ID.fullmatch(parts[0]):
        return None
    return parts[0], parts[2]


class VoiceStore:
    """Thread-safe. `encoder` turns reference audio bytes into codes (it raises VoiceError/ValueError on bad audio);
    `codebooks`, when given, is the number of code rows a stored voice must have (the served model's)."""

    def __init__(self, root: str | Path | None, encoder: Encoder, cache_size: int = 64,
                 codebooks: int | None = None) -> None:
        self.root = Path(root) if root is not None else None
        self.encoder = encoder
        self.codebooks = codebooks
        self._voices: dict[str, Voice] = {}
        self._signatures: dict[str, Signature] = {}  # the directory each voice in memory was read from (or written)
        self._damaged: dict[str, Signature | None] = {}  # warned about once per version
        self._inline: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._recover()
            self._load_all()

    # ------------------------------------------------------------------ disk

    @contextlib.contextmanager
    def _disk_lock(self) -> Iterator[None]:
        """Exclusive among every writer of this directory, in this process or another (rtts voices add)."""
        assert self.root is not None
        fd = os.open(self.root, os.O_RDONLY)  # the directory itself is the lock (flock works on any descriptor)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # (releases the lock)

    def _recover(self) -> None:
        """Finish what a crash interrupted (module docstring): restore backups without their voice, drop the rest."""
        assert self.root is not None
        with self._disk_lock():
            backups: dict[str, list[Path]] = {}
            for d in self.root.iterdir():
                hidden = _hidden(d.name)
                if hidden is None or not d.is_dir():
                    continue
                voice_id, kind = hidden
                if kind == "old":
                    backups.setdefault(voice_id, []).append(d)
                else:  # a write that never swapped in (no writer is active: we hold the lock), or a delete
                    shutil.rmtree(d, ignore_errors=True)
            for voice_id, found in backups.items():
                final = self.root / voice_id
                found.sort(key=lambda p: p.stat().st_mtime_ns)
                if not final.exists():
                    # The swap stopped between its two renames: the old copy is the voice.
                    found.pop().rename(final)
                    log.warning("voice %r: restored from the backup of an interrupted overwrite", voice_id)
                for old in found:
                    shutil.rmtree(old, ignore_errors=True)
            _fsync_dir(self.root)

    def _load_all(self) -> None:
        assert self.root is not None
        for d in sorted(self.root.iterdir()):
            if VOICE_ID.fullmatch(d.name) and d.is_dir():
                self._read_through(d.name)

    def _read_through(self, voice_id: str) -> Voice | None:
        """The voice as the disk has it now (memory updated); None if it is not there or does not read back (then
        the copy in memory, if any, is kept)."""
        assert self.root is not None
        d = self.root / voice_id
        sig = _signature(d)
        if sig is None:
            with self._disk_lock():  # (a swap by another process holds the lock between its two renames)
                sig = _signature(d)
        if sig is None:
            with self._lock:
                self._voices.pop(voice_id, None)
                self._signatures.pop(voice_id, None)
            return None
        try:
            voice = read_voice(d, self.codebooks)
            if _signature(d) != sig:  # swapped while being read (another writer): read again, between writes
                with self._disk_lock():
                    sig = _signature(d) or sig
                    voice = read_voice(d, self.codebooks)
        except DamagedVoice as e:
            with self._lock:
                first = self._damaged.get(voice_id, ...) != sig
                self._damaged[voice_id] = sig
                self._signatures[voice_id] = sig  # (not read again until it changes)
                kept = self._voices.get(voice_id)
            if first:
                log.warning("stored voice %r skipped: %s (%s)%s", voice_id, e, d,
                            "; serving the copy read before" if kept is not None else "")
            return kept
        with self._lock:
            self._voices[voice_id] = voice
            self._signatures[voice_id] = sig
            self._damaged.pop(voice_id, None)
        return voice

    def _current(self, voice_id: str) -> Voice | None:
        """The voice, from memory while its directory is the one it was read from, else from the disk."""
        with self._lock:
            voice = self._voices.get(voice_id)
            known = self._signatures.get(voice_id)
        if self.root is None:
            return voice
        if not VOICE_ID.fullmatch(voice_id):
            return None
        if voice is not None or known is not None:
            sig = _signature(self.root / voice_id)
            if sig is not None and sig == known:
                return voice
        return self._read_through(voice_id)

    def _swap_in(self, voice_id: str, tmp: Path) -> Signature | None:
        """Replace `<id>` by the complete directory `tmp` (held: the disk lock); see the module docstring."""
        assert self.root is not None
        final = self.root / voice_id
        backup = None
        if final.exists():
            backup = self.root / f".{voice_id}.{uuid.uuid4().hex}.old"
            os.rename(final, backup)
            _fsync_dir(self.root)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        if backup is not None:
            shutil.rmtree(backup)
        return _signature(final)

    # ------------------------------------------------------------------ stored voices

    def add(self, voice_id: str, audio: bytes, text: str, meta: VoiceMeta = VoiceMeta()) -> Voice:
        return self.add_samples(voice_id, [(audio, text)], meta)

    def add_samples(self, voice_id: str, samples: list[tuple[bytes, str]], meta: VoiceMeta = VoiceMeta()) -> Voice:
        """A voice from one or more (audio, transcript) clips of one speaker: their codes and transcripts joined in
        order, as if the clips had been one recording. Overwrites a voice of the same id."""
        if not VOICE_ID.fullmatch(voice_id):
            raise VoiceError(f"invalid voice id {voice_id!r}: use 1-128 letters, digits, '_', '-', '.'")
        if not samples:
            raise VoiceError("no reference audio")
        if any(not text.strip() for _, text in samples):
            raise VoiceError("the reference text (transcript of the audio) is empty")
        meta = meta.checked()
        parts = [self.encode(audio) for audio, _ in samples]
        codes = parts[0] if len(parts) == 1 else np.ascontiguousarray(np.concatenate(parts, axis=1))
        text = " ".join(t.strip() for _, t in samples) if len(samples) > 1 else samples[0][1]
        now = time.time()
        voice = Voice(voice_id, text, codes, now, meta, now)
        if self.root is None:
            with self._lock:
                self._voices[voice_id] = voice
            return voice
        with self._disk_lock():
            # Written aside in a directory of this call's own, then swapped in and registered: the last add wins, on
            # disk and in memory alike.
            tmp = Path(tempfile.mkdtemp(prefix=f".{voice_id}.", suffix=".tmp", dir=self.root))
            try:
                _write_durably(tmp / "codes.npy", _npy_bytes(codes))
                _write_durably(tmp / "text.txt", text.encode("utf-8"))
                for i, (audio, _) in enumerate(samples):
                    _write_durably(tmp / ("audio.bin" if len(samples) == 1 else f"audio.{i}.bin"), audio)
                _write_durably(tmp / "meta.json", voice._meta_json().encode("utf-8"))
                _fsync_dir(tmp)
                sig = self._swap_in(voice_id, tmp)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)  # gone already unless something failed
            with self._lock:
                self._voices[voice_id] = voice
                if sig is not None:
                    self._signatures[voice_id] = sig
                self._damaged.pop(voice_id, None)
        return voice

    def get(self, voice_id: str) -> Voice:
        voice = self._current(voice_id)
        if voice is None:
            raise VoiceError(f"unknown reference_id {voice_id!r}")
        return voice

    def update(self, voice_id: str, **changes: Any) -> Voice:
        """Change some VoiceMeta fields of a stored voice (those named); the codes stay, and so does `created` (the key
        under which sessions cache the voice's prefill: a metadata edit does not change the sound)."""
        if self._current(voice_id) is None:
            raise VoiceError(f"unknown reference_id {voice_id!r}")
        with contextlib.ExitStack() as stack:
            if self.root is not None:
                stack.enter_context(self._disk_lock())
            with self._lock:
                old = self._voices.get(voice_id)
                if old is None:
                    raise VoiceError(f"unknown reference_id {voice_id!r}")
                meta = dataclasses.replace(old.meta, **changes).checked()
                voice = dataclasses.replace(old, meta=meta, updated=time.time())
                if self.root is not None:
                    d = self.root / voice_id
                    tmp = d / ".meta.json.tmp"
                    _write_durably(tmp, voice._meta_json().encode("utf-8"))
                    os.replace(tmp, d / "meta.json")  # atomic: a crash leaves the old or the new
                    _fsync_dir(d)
                    sig = _signature(d)
                    if sig is not None:
                        self._signatures[voice_id] = sig
                self._voices[voice_id] = voice
        return voice

    def list(self) -> list[Voice]:
        """Every stored voice that reads back, as the disk has them now."""
        if self.root is not None:
            on_disk = {d.name for d in self.root.iterdir() if VOICE_ID.fullmatch(d.name) and d.is_dir()}
            with self._lock:
                ids = on_disk | set(self._voices)
            for voice_id in ids:
                self._current(voice_id)
        with self._lock:
            return sorted(self._voices.values(), key=lambda v: v.id)

    def delete(self, voice_id: str) -> bool:
        if self.root is None or not VOICE_ID.fullmatch(voice_id):
            with self._lock:
                return self._voices.pop(voice_id, None) is not None
        with self._disk_lock():
            final = self.root / voice_id
            found = final.is_dir()
            if found:
                gone = self.root / f".{voice_id}.{uuid.uuid4().hex}.del"
                os.rename(final, gone)  # one atomic step: a crash after it leaves no half-deleted voice
                _fsync_dir(self.root)
                shutil.rmtree(gone, ignore_errors=True)
            with self._lock:
                found = self._voices.pop(voice_id, None) is not None or found
                self._signatures.pop(voice_id, None)
                self._damaged.pop(voice_id, None)
        return found

    # ------------------------------------------------------------------ inline references

    def encode(self, audio: bytes) -> np.ndarray:
        """Codes of reference audio, from the content-hash cache when this exact audio was seen before."""
        key = hashlib.sha256(audio).hexdigest()
        with self._lock:
            hit = self._inline.get(key)
            if hit is not None:
                self._inline.move_to_end(key)
                return hit
        codes = np.ascontiguousarray(self.encoder(audio), dtype=np.int64)
        with self._lock:
            self._inline[key] = codes
            while len(self._inline) > self._cache_size:
                self._inline.popitem(last=False)
        return codes
