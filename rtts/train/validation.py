"""The DualAR stage's validation: teacher-forced losses on the held-out sentences during training.

The data stage speaks train/heldout.txt too and the tokens stage encodes it (WORKDIR/tokens/heldout/). Training
scores it every `val_every` steps and keeps the weights with the lowest held-out main loss: a character-input model
on a few tens of thousands of sentences can memorize them, and its training loss then keeps falling while what it says
about new text gets worse (bench/results/demo_voice/README.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rtts.model.dual_ar import DualARTransformer
from rtts.model.prompt import PromptBuilder
from rtts.train.loop import autocast
from rtts.train.presets import DualARTraining
from rtts.train.sequences import Batch, Example, SequenceMaker, collate
from rtts.train.tokens import Tokens

HELDOUT = "heldout"  # under WORKDIR/tokens/


@dataclass
class Validation:
    batches: list[Batch]
    utterances: int

    @classmethod
    def load(cls, tokens_dir: Path, builder: PromptBuilder, device: torch.device,
             batch_positions: int) -> Validation | None:
        """The held-out set as padded batches of at most `batch_positions` positions; None when not encoded."""
        root = tokens_dir / HELDOUT
        if not (root / "index.json").is_file():
            return None
        return cls.of(Tokens.load(root), builder, device, batch_positions)

    @classmethod
    def of(cls, tokens: Tokens, builder: PromptBuilder, device: torch.device, batch_positions: int) -> Validation:
        """One turn per utterance, shortest first, in padded batches of at most `batch_positions` positions."""
        maker = SequenceMaker(builder, tokens)
        examples = sorted((maker.example([i]) for i in range(len(maker.tokens.texts))), key=lambda e: e.length)
        batches: list[Batch] = []
        group: list[Example] = []
        for ex in examples:
            if group and (len(group) + 1) * ex.length > batch_positions:
                batches.append(collate(maker, group).to(device))
                group = []
            group.append(ex)
        if group:
            batches.append(collate(maker, group).to(device))
        return cls(batches, len(examples))

    @torch.no_grad()
    def score(self, model: DualARTransformer, main_ids: torch.Tensor, cfg: DualARTraining) -> dict[str, float]:
        """Losses and accuracies over the whole set (eval mode: no dropout), each batch weighted by its utterances."""
        from rtts.train.dualar_train import losses

        was_training = model.training
        model.eval()
        sums: dict[str, float] = {}
        n = 0
        for batch in self.batches:
            with autocast(main_ids.device):
                parts = losses(model, batch, main_ids, cfg, guided=False)
            b = batch.columns.shape[0]
            n += b
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + float(v) * b
        model.train(was_training)
        return {k: v / max(n, 1) for k, v in sums.items()}
