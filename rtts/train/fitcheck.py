"""Fit check: the trained DualAR's teacher-forced losses on training sentences against held-out ones.

The training log shows only training batches. A model that has memorized its sentences reads well there and babbles
on new text; this stage scores both sets the same way (the training loss function, no dropout, one batch each), the
held-out set encoded from the source voice by the checkpoint's own codec, so the two differ only in the text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rtts.train.tokens import Tokens


def subset(tokens: Tokens, idx: list[int]) -> Tokens:
    return Tokens.of([tokens.texts[i] for i in idx], [tokens.utterance(i) for i in idx])


def encoded(checkpoint: Path, texts: list[str], bundle: Path | None, processes: int) -> Tokens:
    """The source voice speaking `texts`, encoded by the checkpoint's codec."""
    from rtts.model.codec import encode_audio, load_codec
    from rtts.train.evaluate import source_audio

    codec = load_codec(checkpoint)
    return Tokens.of(texts, [encode_audio(codec, a).numpy() for a in source_audio(texts, bundle, processes)])


def scores(checkpoint: Path, sets: dict[str, Tokens], preset: str) -> dict[str, dict[str, float]]:
    """The training losses of each set, as the DualAR stage's validation computes them, on the CPU."""
    from rtts.model.loading import load_model
    from rtts.model.prompt import PromptBuilder
    from rtts.train.dualar_train import main_token_ids
    from rtts.train.presets import PRESETS
    from rtts.train.validation import Validation

    loaded = load_model(checkpoint, device=torch.device("cpu"), dtype=torch.float32)
    model, tok = loaded.model, loaded.tokenizer
    builder = PromptBuilder(tok, model.config.num_codebooks, "s2", model.config.codebook_size)
    cfg = PRESETS[preset].dualar_training
    main_ids, cpu = main_token_ids(tok), torch.device("cpu")
    out = {}
    for name, tokens in sets.items():
        v = Validation.of(tokens, builder, cpu, cfg.batch_positions).score(model, main_ids, cfg)
        out[name] = {k: round(x, 4) for k, x in v.items()}
    return out


def fit_check(checkpoint: Path, tokens_dir: Path, heldout: list[str], count: int, preset: str, report: Path,
              bundle: Path | None = None, processes: int = 1) -> dict[str, Any]:
    train = Tokens.load(tokens_dir)
    rng = np.random.default_rng(0)
    idx = sorted(rng.choice(len(train.texts), size=min(count, len(train.texts)), replace=False).tolist())
    sets = {"train": subset(train, idx), "heldout": encoded(checkpoint, heldout[:count], bundle, processes)}
    result: dict[str, Any] = {"checkpoint": str(checkpoint), "count": count, **scores(checkpoint, sets, preset)}
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(json.dumps(result, indent=1) + "\n")
    return result
