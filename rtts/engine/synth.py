"""Single-stream synthesis on one engine slot: the reference's generate loop, used by `rtts synth` and the tests.

The server does the same through the ping-pong scheduler; this path exists so a whole utterance can be produced (and
checked against the golden fixtures) with nothing but an `Engine`. It keeps the conversation in the slot's KV cache:
the voice prompt is prefilled once, each text batch is a turn, and later turns condition on earlier ones.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rtts.engine.engine import Engine
from rtts.model.prompt import PromptBuilder, Reference
from rtts.types import FinishReason, SamplingParams


@dataclass
class Turn:
    text: str
    columns: torch.Tensor  # [rows, N] every sampled column (row 0 token, rows 1.. codes), on the CPU
    finish: FinishReason
    prompt_positions: int  # KV length when generation started

    @property
    def codes(self) -> torch.Tensor:
        """The frames the reference keeps: all but the last sampled one -> [num_codebooks, N - 1]."""
        return self.columns[1:, :-1]


class Synthesizer:
    def __init__(self, engine: Engine, slot: int = 0) -> None:
        self.engine = engine
        self.slot = slot
        cfg = engine.config
        self.builder = PromptBuilder(engine.tokenizer, cfg.num_codebooks, cfg.format, cfg.codebook_size)
        self._turn_open = False

    def start(self, references: Sequence[Reference] = ()) -> int:
        """Begin a conversation on the slot with this voice prompt; returns its length in positions."""
        self.engine.reset_slot(self.slot)
        self._turn_open = False
        cols = self.builder.system(references)
        self.engine.prefill(self.slot, cols)
        return cols.shape[1]

    @torch.inference_mode()
    def turn(
        self,
        text: str,
        params: SamplingParams,
        on_frame: Callable[[torch.Tensor], None] | None = None,
    ) -> Turn:
        """Generate one turn. on_frame receives each sampled column [rows] (CPU) as soon as it is known."""
        eng, slot = self.engine, self.slot
        cols = self.builder.turn(text, after_turn=self._turn_open)
        eng.set_params(slot, params)
        eng.prefill(slot, cols, sample=True)
        prompt_positions = eng.host_pos[slot]
        self._turn_open = True

        # The host reads each step's result one step late, so the device always has the next step queued.
        frames: list[torch.Tensor] = []
        pending = (eng.state.last_col[slot].clone(), eng.state.finish[slot].clone())
        while True:
            launched = eng.decode([slot])
            col, fin = pending[0].cpu(), FinishReason(int(pending[1]))
            frames.append(col)
            if on_frame is not None:
                on_frame(col)
            if fin != FinishReason.RUNNING:
                break
            pending = (launched[0][0], launched[1][0])
        eng.end_turn(slot)
        return Turn(text, torch.stack(frames, dim=1), fin, prompt_positions)

    def synthesize(self, text: str, params: SamplingParams, chunk_length: int = 300) -> list[Turn]:
        """The reference's text batching: one turn per batch (S2 splits at speaker tags; S1 never splits)."""
        return [self.turn(batch, params) for batch in self.builder.split_batches(text, chunk_length)]
