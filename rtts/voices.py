"""Voices: stored references (`reference_id`) persisted on disk, and inline references cached by content hash.

A voice is a transcript plus codec codes [num_codebooks, frames]; audio is encoded once (when added, or the first
time an inline reference is seen) and never again. Stored voices live in `<voices_dir>/<id>/` as `codes.npy`,
`text.txt` and `meta.json` (creation time, and the SDK's voice metadata: title, description, tags, visibility, last
update); the original audio is kept beside them as `audio.bin` (`audio.<i>.bin` per sample of a voice added from
several clips) for re-encoding with another codec.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rtts.audio.io import AudioError, read_audio
from rtts.model.codec import Codec, encode_audio

VOICE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # whole id (fullmatch: "$" would admit a final newline)


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


class VoiceStore:
    """Thread-safe. `encoder` turns reference audio bytes into codes (it raises VoiceError/ValueError on bad audio)."""

    def __init__(self, root: str | Path | None, encoder: Encoder, cache_size: int = 64) -> None:
        self.root = Path(root) if root is not None else None
        self.encoder = encoder
        self._voices: dict[str, Voice] = {}
        self._inline: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._load_all()

    # ------------------------------------------------------------------ stored voices

    def _load_all(self) -> None:
        assert self.root is not None
        for d in sorted(self.root.iterdir()):
            if not VOICE_ID.fullmatch(d.name):  # e.g. a `.id.*.tmp` left by a crash mid-add: not a voice
                if d.name.startswith(".") and d.name.endswith(".tmp"):
                    shutil.rmtree(d, ignore_errors=True)
                continue
            if not (d / "codes.npy").exists():
                continue
            try:
                meta = json.loads((d / "meta.json").read_text())
                codes = np.load(d / "codes.npy", allow_pickle=False)
                created = float(meta.get("created", 0))
                vm = VoiceMeta(str(meta.get("title", "")), str(meta.get("description", "")),
                               tuple(str(t) for t in meta.get("tags", [])), str(meta.get("visibility", "private")))
                self._voices[d.name] = Voice(d.name, (d / "text.txt").read_text(), codes, created, vm,
                                             float(meta.get("updated", created)))
            except (OSError, ValueError, TypeError):
                continue  # a half-written voice from a crash: skip it rather than refuse to start

    def add(self, voice_id: str, audio: bytes, text: str, meta: VoiceMeta = VoiceMeta()) -> Voice:
        return self.add_samples(voice_id, [(audio, text)], meta)

    def add_samples(self, voice_id: str, samples: list[tuple[bytes, str]], meta: VoiceMeta = VoiceMeta()) -> Voice:
        """A voice from one or more (audio, transcript) clips of one speaker: their codes and transcripts joined in
        order, as if the clips had been one recording."""
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
        # Written aside in a directory of this call's own (concurrent adds of one id must not share it), then
        # swapped in and registered under one lock: the last add wins, on disk and in memory alike.
        tmp = Path(tempfile.mkdtemp(prefix=f".{voice_id}.", suffix=".tmp", dir=self.root))
        try:
            np.save(tmp / "codes.npy", codes)
            (tmp / "text.txt").write_text(text)
            for i, (audio, _) in enumerate(samples):
                (tmp / ("audio.bin" if len(samples) == 1 else f"audio.{i}.bin")).write_bytes(audio)
            (tmp / "meta.json").write_text(voice._meta_json())
            with self._lock:
                final = self.root / voice_id
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
                self._voices[voice_id] = voice
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone already unless something failed
        return voice

    def get(self, voice_id: str) -> Voice:
        with self._lock:
            voice = self._voices.get(voice_id)
        if voice is None:
            raise VoiceError(f"unknown reference_id {voice_id!r}")
        return voice

    def update(self, voice_id: str, **changes: Any) -> Voice:
        """Change some VoiceMeta fields of a stored voice (those named); the codes stay, and so does `created` (the key
        under which sessions cache the voice's prefill: a metadata edit does not change the sound)."""
        with self._lock:
            old = self._voices.get(voice_id)
            if old is None:
                raise VoiceError(f"unknown reference_id {voice_id!r}")
            meta = dataclasses.replace(old.meta, **changes).checked()
            voice = dataclasses.replace(old, meta=meta, updated=time.time())
            if self.root is not None:
                tmp = self.root / voice_id / ".meta.json.tmp"
                tmp.write_text(voice._meta_json())
                tmp.replace(self.root / voice_id / "meta.json")  # atomic: a crash leaves the old or the new
            self._voices[voice_id] = voice
        return voice

    def list(self) -> list[Voice]:
        with self._lock:
            return sorted(self._voices.values(), key=lambda v: v.id)

    def delete(self, voice_id: str) -> bool:
        with self._lock:
            found = self._voices.pop(voice_id, None) is not None
            if self.root is not None and VOICE_ID.fullmatch(voice_id):
                shutil.rmtree(self.root / voice_id, ignore_errors=True)
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
