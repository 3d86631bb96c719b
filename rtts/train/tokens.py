"""Tokens stage: every utterance of the store encoded by the trained codec, loaded through the server's own loader
(`load_codec`), so the DualAR learns exactly the codes the server's codec produces and decodes.

Output: `codes.npy` (uint16 [num_codebooks, total frames], all utterances one after another) split into parts of at
most 15 MB (`codes.partNNN.npy`), and `index.json` (per utterance: text, first frame, frame count). The encoder is
causal, so right-padding a batch to its longest utterance leaves every utterance's own frames unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rtts.model.codec import load_codec
from rtts.train.dataset import Store

PART_BYTES = 15 * 1000 * 1000


@dataclass
class Tokens:
    texts: list[str]
    starts: np.ndarray  # [U] first frame of each utterance
    frames: np.ndarray  # [U] frame counts
    codes: np.ndarray  # [num_codebooks, total frames] uint16

    def utterance(self, i: int) -> np.ndarray:
        s = int(self.starts[i])
        return self.codes[:, s:s + int(self.frames[i])]

    @classmethod
    def of(cls, texts: list[str], utterances: list[np.ndarray]) -> Tokens:
        """Utterances' codes ([num_codebooks, frames] each) laid end to end, in order."""
        frames = np.array([u.shape[1] for u in utterances], np.int64)
        starts = np.concatenate([[0], np.cumsum(frames)[:-1]]).astype(np.int64)
        return cls(list(texts), starts, frames, np.concatenate(utterances, axis=1).astype(np.uint16))

    @classmethod
    def load(cls, root: Path) -> Tokens:
        index = json.loads((root / "index.json").read_text())
        parts = [np.load(root / name) for name in index["parts"]]
        codes = np.concatenate(parts, axis=1)
        return cls([u["text"] for u in index["utts"]], np.array([u["start"] for u in index["utts"]], np.int64),
                   np.array([u["frames"] for u in index["utts"]], np.int64), codes)


@torch.inference_mode()
def encode_store(store: Store, codec_dir: Path, out: Path, device: torch.device,
                 batch_seconds: float | None = None) -> Tokens:
    # Big batches feed the GPU; on a CPU they only cost page faults.
    batch_seconds = batch_seconds or (600.0 if device.type == "cuda" else 20.0)
    codec = load_codec(codec_dir, device=device, dtype=torch.float32)
    frame = codec.config.frame_length
    if store.sample_rate != codec.config.sample_rate:
        raise ValueError(f"audio is {store.sample_rate} Hz, the codec runs at {codec.config.sample_rate} Hz")
    order = sorted(range(len(store.utts)), key=lambda i: store.utts[i].length)
    per_utt: dict[int, np.ndarray] = {}
    i = 0
    while i < len(order):
        longest = store.utts[order[min(len(order) - 1, i)]].length
        n = max(1, int(batch_seconds * store.sample_rate // max(longest, 1)))
        group = order[i:i + n]
        longest = max(store.utts[j].length for j in group)
        batch = np.zeros((len(group), longest), np.float32)
        for row, j in enumerate(group):
            batch[row, :store.utts[j].length] = store.float_audio(j)
        codes = codec.encode(torch.from_numpy(batch).to(device)).cpu().numpy()
        for row, j in enumerate(group):
            per_utt[j] = codes[row, :, : -(-store.utts[j].length // frame)]
        i += len(group)
    toks = Tokens.of([u.text for u in store.utts], [per_utt[j] for j in range(len(store.utts))])
    all_codes = toks.codes
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("codes.part*.npy"):
        old.unlink()
    per_part = max(1, PART_BYTES // (all_codes.shape[0] * 2))
    names = []
    for k, s in enumerate(range(0, all_codes.shape[1], per_part)):
        names.append(f"codes.part{k:03d}.npy")
        np.save(out / names[-1], all_codes[:, s:s + per_part])
    index = {"parts": names, "num_codebooks": int(all_codes.shape[0]), "frame_rate": codec.config.sample_rate / frame,
             "utts": [{"text": t, "start": int(s), "frames": int(f)}
                      for t, s, f in zip(toks.texts, toks.starts, toks.frames)]}
    (out / "index.json").write_text(json.dumps(index) + "\n")
    return toks
