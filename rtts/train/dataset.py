"""The utterance store the data stage writes and every later stage reads.

A folder with:
- `audio.i16`: all utterances' 16 kHz int16 samples, one after another (memory-mapped when read);
- `utts.jsonl`: one line per utterance: text, offset and length in samples, flite's phone end times;
- `meta.json`: sample rate, voice, count and total seconds.
Written to `<dir>.tmp` and renamed, so an interrupted run leaves no half-written store behind.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from rtts.train.flite import Spoken


@dataclass(frozen=True)
class Utterance:
    text: str
    offset: int
    length: int
    phones: list[tuple[str, float]]


@dataclass
class Store:
    root: Path
    sample_rate: int
    utts: list[Utterance]
    audio: np.ndarray  # int16 [total samples], memory-mapped

    def samples(self, i: int) -> np.ndarray:
        u = self.utts[i]
        return np.asarray(self.audio[u.offset:u.offset + u.length])

    def float_audio(self, i: int) -> np.ndarray:
        return self.samples(i).astype(np.float32) / 32768.0

    @property
    def seconds(self) -> float:
        return sum(u.length for u in self.utts) / self.sample_rate

    @classmethod
    def load(cls, root: Path) -> Store:
        meta = json.loads((root / "meta.json").read_text())
        utts = []
        for line in (root / "utts.jsonl").read_text().splitlines():
            d = json.loads(line)
            utts.append(Utterance(d["text"], int(d["offset"]), int(d["length"]), [tuple(p) for p in d["phones"]]))
        audio = np.memmap(root / "audio.i16", dtype=np.int16, mode="r")
        return cls(root, int(meta["sample_rate"]), utts, audio)


def write(root: Path, spoken: Iterable[Spoken], sample_rate: int, voice: str, log_every: int = 0) -> Store:
    """Stream utterances into a new store at root (replacing any old one)."""
    tmp = root.with_name(root.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    offset, count = 0, 0
    with open(tmp / "audio.i16", "wb") as audio, open(tmp / "utts.jsonl", "w") as index:
        for s in spoken:
            audio.write(s.audio.astype("<i2").tobytes())
            index.write(json.dumps({"text": s.text, "offset": offset, "length": int(s.audio.size),
                                    "phones": s.phones}) + "\n")
            offset += int(s.audio.size)
            count += 1
            if log_every and count % log_every == 0:
                print(f"data: {count} utterances, {offset / sample_rate / 3600:.2f} h", flush=True)
    meta = {"sample_rate": sample_rate, "voice": voice, "count": count, "seconds": offset / sample_rate}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    return Store.load(root)
