"""Training sequences in exactly the layout the server feeds (rtts/model/prompt.py), built by the server's own
`PromptBuilder`:

    system()              "<|im_start|>system\\nconvert the provided text to speech<|im_end|>\\n"
    turn(text_1)          "<|im_start|>user\\n" text "<|im_end|>\\n<|im_start|>assistant\\n<|voice|>"
    codes_1               one column per frame
    [turn(text_2, True)   a live session's next turn: "<|im_end|>\\n<|im_start|>user\\n..."
     codes_2]
    "<|im_end|>"          the stop token after the last frame

Targets: the position before each frame predicts its main token (c0 as `<|semantic:c0|>`) and, through the fast
transformer, c1..; the last frame of a turn predicts `<|im_end|>` (EOS supervision). Each turn records its text span
and its frame-predicting query span for the guided-attention loss.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from rtts.model.prompt import PromptBuilder
from rtts.train.tokens import Tokens

MAX_TURNS = 2


@dataclass
class Example:
    columns: torch.Tensor  # [rows, S] int64
    spans: list[tuple[int, int, int, int]]  # per turn: text start, text end, first query, end of queries


class SequenceMaker:
    def __init__(self, builder: PromptBuilder, tokens: Tokens) -> None:
        self.builder = builder
        self.tokens = tokens
        self.system = builder.system()
        self.end = builder.columns(["<|im_end|>"])
        self.sem_begin = builder.tok.semantic_begin_id
        if tokens.codes.size and (int(tokens.codes[0].max()) >= builder.tok.num_semantic
                                  or int(tokens.codes.max()) >= builder.codebook_size):
            raise ValueError("tokens out of the model's code range")
        # Turn columns are tokenized once per utterance and form (built on demand: batches must not wait on text).
        self._turns: dict[tuple[int, bool], tuple[torch.Tensor, int, int]] = {}

    def turn(self, i: int, after: bool) -> tuple[torch.Tensor, int, int]:
        """The server's turn columns for utterance i -> (columns, text start, text end) within them."""
        cached = self._turns.get((i, after))
        if cached is not None:
            return cached
        cols = self.builder.turn(self.tokens.texts[i], after_turn=after)
        ids = self.builder.tok.encode(self.tokens.texts[i])
        prefix = self.builder.columns((["<|im_end|>\n"] if after else []) + ["<|im_start|>user\n"]).shape[1]
        if cols[0, prefix:prefix + len(ids)].tolist() != ids:
            raise AssertionError("the prompt builder's turn layout changed: update sequences.py")
        self._turns[(i, after)] = cols.to(torch.int32), prefix, prefix + len(ids)
        return self._turns[(i, after)]

    def frames(self, i: int) -> torch.Tensor:
        """Utterance i's codes as prompt columns (PromptBuilder.assistant_codes' layout, without its per-call
        checks: the range was checked once above)."""
        codes = torch.from_numpy(self.tokens.utterance(i).astype(np.int64))
        return torch.cat([codes[:1] + self.sem_begin, codes], dim=0)

    def example(self, utts: list[int]) -> Example:
        blocks = [self.system]
        pos = self.system.shape[1]
        spans = []
        for k, i in enumerate(utts):
            cols, ts, te = self.turn(i, after=k > 0)
            frames = self.frames(i)
            q0 = pos + cols.shape[1] - 1  # <|voice|>: predicts frame 0
            spans.append((pos + ts, pos + te, q0, q0 + frames.shape[1] + 1))  # ... the last frame predicts the stop
            blocks += [cols.long(), frames]
            pos += cols.shape[1] + frames.shape[1]
        blocks.append(self.end)
        return Example(torch.cat(blocks, dim=1), spans)


@dataclass
class Batch:
    columns: torch.Tensor  # [B, rows, S]
    main_target: torch.Tensor  # [B, S] index into main ids (semantic code, or num_semantic for <|im_end|>); -1: none
    frame_mask: torch.Tensor  # [B, S] bool: positions whose target is a frame (the fast transformer trains there)
    spans: torch.Tensor  # [B, MAX_TURNS, 4] int64 (text start, text end, query start, query end); -1 when absent

    def to(self, device: torch.device) -> Batch:
        return Batch(self.columns.to(device), self.main_target.to(device), self.frame_mask.to(device),
                     self.spans.to(device))


def collate(examples: list[Example], sem_begin: int, num_semantic: int, im_end: int) -> Batch:
    rows = examples[0].columns.shape[0]
    S = max(e.columns.shape[1] for e in examples)
    cols = torch.zeros(len(examples), rows, S, dtype=torch.int64)
    spans = torch.full((len(examples), MAX_TURNS, 4), -1, dtype=torch.int64)
    for b, e in enumerate(examples):
        cols[b, :, :e.columns.shape[1]] = e.columns
        spans[b, :len(e.spans)] = torch.tensor(e.spans)
    nxt = torch.cat([cols[:, 0, 1:], torch.zeros(len(examples), 1, dtype=torch.int64)], dim=1)
    is_frame_next = (nxt >= sem_begin) & (nxt < sem_begin + num_semantic)
    is_frame_here = (cols[:, 0] >= sem_begin) & (cols[:, 0] < sem_begin + num_semantic)
    eos = (nxt == im_end) & is_frame_here  # a turn's last frame predicts the stop token
    target = torch.full_like(nxt, -1)
    target = torch.where(is_frame_next, nxt - sem_begin, target)
    target = torch.where(eos, torch.full_like(nxt, num_semantic), target)
    return Batch(cols, target, is_frame_next, spans)


def batches(maker: SequenceMaker, batch_positions: int, max_frames: int, multi_turn: float, seed: int,
            pool_batches: int = 32) -> Iterator[list[Example]]:
    """Endless batches of similar-length examples, at most `batch_positions` padded positions each."""
    rng = np.random.default_rng(seed)
    frames = maker.tokens.frames
    usable = np.flatnonzero((frames > 0) & (frames <= max_frames))
    if usable.size == 0:
        raise ValueError(f"no utterance has 1..{max_frames} frames")
    while True:
        pool: list[Example] = []
        target = pool_batches * max(1, batch_positions // (int(frames[usable].mean()) + 80))
        while len(pool) < target:
            n = MAX_TURNS if rng.random() < multi_turn else 1
            pick = [int(i) for i in rng.choice(usable, n)]
            if n > 1 and frames[pick].sum() > max_frames:
                pick = pick[:1]
            pool.append(maker.example(pick))
        pool.sort(key=lambda e: e.columns.shape[1])
        groups: list[list[Example]] = []
        current: list[Example] = []
        for e in pool:
            if current and (len(current) + 1) * e.columns.shape[1] > batch_positions:
                groups.append(current)
                current = []
            current.append(e)
        if current:
            groups.append(current)
        for k in rng.permutation(len(groups)):
            yield groups[int(k)]
