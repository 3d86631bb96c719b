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

Speed: a GPU step takes tens of milliseconds, so batches are not assembled from per-example tensors. The turn's
fixed parts are tokenized once, each text once, the layout is checked against `PromptBuilder.turn` on a sample, and
`collate` writes every example's columns straight into one array.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from rtts.model.prompt import PromptBuilder
from rtts.train.tokens import Tokens

MAX_TURNS = 3  # a live session conditions each sentence on the ones before it (condition_on_previous_chunks)
LAYOUT_CHECKS = 32  # utterances whose turns are compared with PromptBuilder.turn itself


@dataclass(frozen=True)
class Example:
    utts: tuple[int, ...]  # one turn per utterance
    length: int  # positions, the final <|im_end|> included
    spans: tuple[tuple[int, int, int, int], ...]  # per turn: text start, text end, first query, end of queries


class SequenceMaker:
    def __init__(self, builder: PromptBuilder, tokens: Tokens) -> None:
        self.builder = builder
        self.tokens = tokens
        self.rows = builder.num_codebooks + 1
        self.system = builder.system()
        self.sem_begin = builder.tok.semantic_begin_id
        self.im_end = builder.tok.im_end_id
        # A turn's parts are tokenized one by one (PromptBuilder.columns), so its row 0 is prefix + text + suffix.
        self.prefix = {after: builder.columns((["<|im_end|>\n"] if after else []) + ["<|im_start|>user\n"])[0].numpy()
                       for after in (False, True)}
        self.suffix = builder.columns(["<|im_end|>\n", "<|im_start|>assistant\n<|voice|>"])[0].numpy()
        self.text_ids = [np.asarray(builder.tok.encode(t), dtype=np.int64) for t in tokens.texts]
        if tokens.codes.size and (int(tokens.codes[0].max()) >= builder.tok.num_semantic
                                  or int(tokens.codes.max()) >= builder.codebook_size):
            raise ValueError("tokens out of the model's code range")
        for i in range(min(LAYOUT_CHECKS, len(tokens.texts))):
            for after in (False, True):
                expected = builder.turn(tokens.texts[i], after_turn=after)
                row0 = np.concatenate([self.prefix[after], self.text_ids[i], self.suffix])
                if not (np.array_equal(expected[0].numpy(), row0) and not expected[1:].any()):
                    raise AssertionError("the prompt builder's turn layout changed: update sequences.py")

    def example(self, utts: list[int]) -> Example:
        pos = self.system.shape[1]
        spans = []
        for k, i in enumerate(utts):
            ts = pos + len(self.prefix[k > 0])
            te = ts + len(self.text_ids[i])
            q0 = te + len(self.suffix) - 1  # <|voice|>: predicts frame 0
            frames = int(self.tokens.frames[i])
            spans.append((ts, te, q0, q0 + frames + 1))  # ... and the last frame predicts the stop
            pos = q0 + 1 + frames
        return Example(tuple(utts), pos + 1, tuple(spans))

    def fill(self, ex: Example, out: np.ndarray) -> None:
        """Write the example's columns into out [rows, >= ex.length] (zeros beyond what it writes)."""
        n = self.system.shape[1]
        out[:, :n] = self.system.numpy()
        for k, (i, (ts, te, q0, _)) in enumerate(zip(ex.utts, ex.spans)):
            out[0, n:ts] = self.prefix[k > 0]
            out[0, ts:te] = self.text_ids[i]
            out[0, te:q0 + 1] = self.suffix
            codes = self.tokens.utterance(i)
            f0 = q0 + 1
            out[0, f0:f0 + codes.shape[1]] = codes[0].astype(np.int64) + self.sem_begin
            out[1:, f0:f0 + codes.shape[1]] = codes
            n = f0 + codes.shape[1]
        out[0, n] = self.im_end

    def columns(self, ex: Example) -> torch.Tensor:
        """One example as a [rows, length] tensor."""
        out = np.zeros((self.rows, ex.length), np.int64)
        self.fill(ex, out)
        return torch.from_numpy(out)


@dataclass
class Batch:
    columns: torch.Tensor  # [B, rows, S]
    main_target: torch.Tensor  # [B, S] index into main ids (semantic code, or num_semantic for <|im_end|>); -1: none
    frame_mask: torch.Tensor  # [B, S] bool: positions whose target is a frame (the fast transformer trains there)
    spans: torch.Tensor  # [B, MAX_TURNS, 4] int64 (text start, text end, query start, query end); -1 when absent

    def to(self, device: torch.device) -> Batch:
        return Batch(self.columns.to(device, non_blocking=True), self.main_target.to(device, non_blocking=True),
                     self.frame_mask.to(device, non_blocking=True), self.spans.to(device, non_blocking=True))


def collate(maker: SequenceMaker, examples: list[Example]) -> Batch:
    S = max(e.length for e in examples)
    arr = np.zeros((len(examples), maker.rows, S), np.int64)
    spans = np.full((len(examples), MAX_TURNS, 4), -1, np.int64)
    for b, e in enumerate(examples):
        maker.fill(e, arr[b])
        spans[b, :len(e.spans)] = e.spans
    cols = torch.from_numpy(arr)
    sem_begin, num_semantic = maker.sem_begin, maker.builder.tok.num_semantic
    nxt = torch.cat([cols[:, 0, 1:], torch.zeros(len(examples), 1, dtype=torch.int64)], dim=1)
    is_frame_next = (nxt >= sem_begin) & (nxt < sem_begin + num_semantic)
    is_frame_here = (cols[:, 0] >= sem_begin) & (cols[:, 0] < sem_begin + num_semantic)
    eos = (nxt == maker.im_end) & is_frame_here  # a turn's last frame predicts the stop token
    target = torch.full_like(nxt, -1)
    target = torch.where(is_frame_next, nxt - sem_begin, target)
    target = torch.where(eos, torch.full_like(nxt, num_semantic), target)
    return Batch(cols, target, is_frame_next, torch.from_numpy(spans))


def batches(maker: SequenceMaker, batch_positions: int, max_frames: int, multi_turn: float, seed: int,
            pool_batches: int = 32) -> Iterator[list[Example]]:
    """Endless batches of similar-length examples, at most `batch_positions` padded positions each.

    A share `multi_turn` of the examples holds two turns and half of those three, as long as all their frames stay
    within 1.5 x max_frames (one utterance: max_frames)."""
    rng = np.random.default_rng(seed)
    frames = maker.tokens.frames
    usable = np.flatnonzero((frames > 0) & (frames <= max_frames))
    if usable.size == 0:
        raise ValueError(f"no utterance has 1..{max_frames} frames")
    while True:
        size = pool_batches * max(1, batch_positions // (int(frames[usable].mean()) + 80))
        picks = usable[rng.integers(0, usable.size, (size, MAX_TURNS))]
        draw = rng.random(size)
        turns = 1 + (draw < multi_turn) + (draw < multi_turn / 2)  # 1, 2 or 3 turns
        cap = int(1.5 * max_frames)
        cum = np.cumsum(frames[picks], axis=1)  # frames of the first 1, 2, 3 turns
        while True:  # drop a turn from examples over the cap until all fit
            over = (cum[np.arange(size), turns - 1] > cap) & (turns > 1)
            if not over.any():
                break
            turns = turns - over
        pool = [maker.example([int(i) for i in row[:n]]) for row, n in zip(picks, turns)]
        pool.sort(key=lambda e: e.length)
        groups: list[list[Example]] = []
        current: list[Example] = []
        for e in pool:
            if current and (len(current) + 1) * e.length > batch_positions:
                groups.append(current)
                current = []
            current.append(e)
        if current:
            groups.append(current)
        for k in rng.permutation(len(groups)):
            yield groups[int(k)]


def prefetched(maker: SequenceMaker, stream: Iterator[list[Example]], depth: int = 6) -> Iterator[Batch]:
    """Collated batches made by a background thread, `depth` ahead, so the GPU does not wait for numpy."""
    q: queue.Queue[Batch | BaseException] = queue.Queue(maxsize=depth)

    def work() -> None:
        try:
            while True:
                q.put(collate(maker, next(stream)))
        except BaseException as e:  # handed to the consumer, which raises it
            q.put(e)

    threading.Thread(target=work, name="batches", daemon=True).start()
    while True:
        item = q.get()
        if isinstance(item, BaseException):
            raise item
        yield item
