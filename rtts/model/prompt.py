"""Prompt columns for plain synthesis, voice cloning and multi-turn continuation.

A prompt is an int64 tensor [num_codebooks + 1, T]: row 0 token ids, rows 1.. codes on semantic positions (zeros on
text positions). Each text part is tokenized separately and the ids concatenated, so BPE merges never cross part
boundaries; a codes part contributes one column per frame (row 0 = semantic_begin + c0).

The prompt is built in pieces that match how a live stream prefills its KV cache:
- `system(references)`: the voice prompt, prefilled once when a session starts;
- `turn(text, after_turn)`: one text turn, ending where generation starts (`after_turn` first closes the previous
  assistant turn, whose generated codes are already in the KV cache);
- `assistant_codes(codes)`: a finished assistant turn, for rebuilding a whole conversation in one tensor.

S2 (`fish_qwen3_omni`) uses chat framing; S1 (`dual_ar`) uses `<|interleave|>` + `<|speaker:0|>` blocks.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rtts.model.errors import PromptError
from rtts.model.tokenizer import FishTokenizer

_SPEAKER = re.compile(r"<\|speaker:\d+\|>")

Part = str | torch.Tensor  # text, or codes [num_codebooks, frames]


@dataclass(frozen=True)
class Reference:
    """A voice reference: its transcript, its codec codes [num_codebooks, frames], and the speaker it voices (None:
    its position among the references, the numbering of a plain list)."""

    text: str
    codes: torch.Tensor
    speaker: int | None = None


class PromptBuilder:
    def __init__(self, tokenizer: FishTokenizer, num_codebooks: int, model_format: str, codebook_size: int) -> None:
        self.tok = tokenizer
        self.num_codebooks = num_codebooks
        self.format = model_format
        self.codebook_size = codebook_size

    # ------------------------------------------------------------------ assembling parts

    def columns(self, parts: Sequence[Part]) -> torch.Tensor:
        """Parts -> [num_codebooks + 1, T] int64."""
        blocks: list[torch.Tensor] = []
        for part in parts:
            if isinstance(part, str):
                ids = self.tok.encode(part)
                block = torch.zeros(self.num_codebooks + 1, len(ids), dtype=torch.int64)
                block[0] = torch.tensor(ids, dtype=torch.int64)
            else:
                codes = self.check_codes(part)
                block = torch.zeros(self.num_codebooks + 1, codes.shape[1], dtype=torch.int64)
                block[0] = codes[0] + self.tok.semantic_begin_id
                block[1:] = codes
            blocks.append(block)
        if not blocks:
            return torch.zeros(self.num_codebooks + 1, 0, dtype=torch.int64)
        return torch.cat(blocks, dim=1)

    def check_codes(self, codes: torch.Tensor | np.ndarray) -> torch.Tensor:
        codes = torch.as_tensor(codes)
        if codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise PromptError(f"reference codes must be integers, got {codes.dtype}")
        if codes.ndim != 2 or codes.shape[0] != self.num_codebooks:
            raise PromptError(
                f"reference codes must have shape [{self.num_codebooks}, frames], got {list(codes.shape)}"
            )
        if codes.shape[1] == 0:
            raise PromptError("reference codes have no frames")
        codes = codes.to(torch.int64)
        too_big = int(codes[0].max()) >= self.tok.num_semantic or int(codes.max()) >= self.codebook_size
        if int(codes.min()) < 0 or too_big:
            raise PromptError(
                f"reference codes out of range (semantic row must be < {self.tok.num_semantic}, "
                f"others < {self.codebook_size})"
            )
        return codes.cpu()

    # ------------------------------------------------------------------ the pieces

    def system(self, references: Sequence[Reference] = ()) -> torch.Tensor:
        """The voice prompt (everything before the first text turn)."""
        if self.format == "s1":
            parts: list[Part] = ["<|interleave|>"]
            for ref in references:
                # S1: every reference is its own block and always gets speaker 0, even one already tagged.
                parts += ["<|speaker:0|>", ref.text, ref.codes, "<|im_end|>"]
            return self.columns(parts)
        if not references:
            return self.columns(["<|im_start|>system\n", "convert the provided text to speech", "<|im_end|>\n"])
        texts = [r.text if _SPEAKER.search(r.text) else f"<|speaker:{i if r.speaker is None else r.speaker}|>{r.text}"
                 for i, r in enumerate(references)]
        codes = torch.cat([self.check_codes(r.codes) for r in references], dim=1)
        return self.columns([
            "<|im_start|>system\n",
            "convert the provided text to speech reference to the following:\n\nText:\n",
            "\n".join(texts),
            "\n\nSpeech:\n",
            codes,
            "<|im_end|>\n",
        ])

    def turn(self, text: str, after_turn: bool = False) -> torch.Tensor:
        """One text turn up to the point where generation starts.

        after_turn: a previous assistant turn is open (its codes are in the context) and must be closed first.
        """
        if not text.strip():
            raise PromptError("text is empty")
        if self.format == "s1":
            return self.columns((["<|im_end|>"] if after_turn else []) + ["<|speaker:0|>", text])
        return self.columns(
            (["<|im_end|>\n"] if after_turn else [])
            + ["<|im_start|>user\n", text, "<|im_end|>\n", "<|im_start|>assistant\n<|voice|>"]
        )

    def assistant_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Generated codes [num_codebooks, N] as conversation history (the turn prefix was already emitted)."""
        return self.columns([codes]) if codes.shape[1] else self.columns([])

    def conversation(
        self, references: Sequence[Reference], turns: Sequence[tuple[str, torch.Tensor | None]]
    ) -> torch.Tensor:
        """A whole conversation in one tensor: turns = [(text, generated codes or None for the last)]."""
        pieces = [self.system(references)]
        for i, (text, codes) in enumerate(turns):
            pieces.append(self.turn(text, after_turn=i > 0))
            if codes is not None:
                pieces.append(self.assistant_codes(codes))
        return torch.cat(pieces, dim=1)

    # ------------------------------------------------------------------ text batching

    def split_batches(self, text: str, chunk_length: int) -> list[str]:
        """How the reference splits one request's text into generations.

        S2: without `<|speaker:N|>` tags the whole text is one batch. With tags: split into turns at the tags (each turn
        keeps its tag, whitespace stripped, text before the first tag dropped), then group consecutive turns into
        batches of at most 5 turns and at most `chunk_length` UTF-8 bytes (a longer single turn stays whole), joined
        with "\n". S1: always one generation.
        """
        if self.format == "s1" or not _SPEAKER.search(text):
            return [text]
        turns: list[str] = []
        matches = list(_SPEAKER.finditer(text))
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
            body = text[m.end():end].strip()
            turns.append(f"{m.group(0)}{body}")
        batches: list[list[str]] = []
        size = 0
        for t in turns:
            n = len(t.encode("utf-8"))
            if batches and len(batches[-1]) < 5 and size + n <= chunk_length:
                batches[-1].append(t)
                size += n
            else:
                batches.append([t])
                size = n
        return ["\n".join(b) for b in batches]
