"""DualAR stage: train the server's `DualARTransformer` on the codec's tokens (resumable; checkpoints every N steps).

Losses:
- main: cross-entropy over what the server samples the main token from (the semantic ids + `<|im_end|>`), at every
  position that predicts a frame or the stop; the stop target is weighted `eos_weight` (one per turn, it would
  otherwise be drowned by the frames, and a model that never stops is the worst failure);
- fast: cross-entropy of every codebook of every frame (position 0 predicts c0 as in the reference's training; the
  server reads c0 from the main head and positions 1.. for the rest);
- guided attention (DC-TTS): the first head of each `guided_layers` layer is pulled onto the diagonal of the current
  turn's text: a query at fraction n of its turn's frames pays 1 - exp(-(n - t)^2 / 2 sigma^2) for attention at
  fraction t of the text and 1 for attention anywhere else. Its weight decays to 10% by `guided_until`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rtts.model.config import DualARConfig
from rtts.model.dual_ar import DualARTransformer
from rtts.model.prompt import PromptBuilder
from rtts.model.tokenizer import FishTokenizer, load_tokenizer
from rtts.train import dualar_forward as fwd
from rtts.train import state
from rtts.train.loop import Deadline, Log, StepBudget, autocast, cosine_lr, set_lr
from rtts.train.presets import DualARTraining, Preset
from rtts.train.sequences import Batch, SequenceMaker, batches, prefetched
from rtts.train.text import config_json, write_tokenizer
from rtts.train.tokens import Tokens
from rtts.train.validation import Validation

STATE = "dualar_state"
WEIGHTS = "dualar_weights"
BEST = "dualar_best"  # the weights with the lowest held-out main loss so far, and that loss


def guided_loss(probs: list[torch.Tensor], spans: torch.Tensor, sigma: float) -> torch.Tensor:
    """probs: per layer [B, 1, S, S]; spans [B, turns, 4] -> mean penalty per guided query."""
    B, _, S, _ = probs[0].shape
    dev = probs[0].device
    q = torch.arange(S, device=dev)[None, :, None].float()
    k = torch.arange(S, device=dev)[None, None, :].float()
    weight = torch.zeros(B, S, S, device=dev)
    queries = torch.zeros(B, S, device=dev)
    for j in range(spans.shape[1]):
        ts, te, qs, qe = (spans[:, j, i].float()[:, None, None] for i in range(4))
        present = (spans[:, j, 0] >= 0)[:, None, None]
        in_q = (q >= qs) & (q < qe) & present
        in_k = (k >= ts) & (k < te)
        diag = (q - qs) / (qe - qs).clamp(min=1) - (k - ts) / (te - ts).clamp(min=1)
        w = torch.where(in_k, 1 - torch.exp(-diag.pow(2) / (2 * sigma**2)), torch.ones((), device=dev))
        weight = torch.where(in_q, w, weight)
        queries = queries + in_q[..., 0].float()
    total = sum((p[:, 0] * weight).sum() for p in probs)
    return total / (queries.sum() * len(probs)).clamp(min=1)


def main_token_ids(tok: FishTokenizer) -> torch.Tensor:
    """The ids the server samples the main token from (S2: the semantic ids, then <|im_end|>): the main head's
    classes, in the order `losses` indexes them."""
    return torch.cat([torch.arange(tok.semantic_begin_id, tok.semantic_end_id + 1), torch.tensor([tok.im_end_id])])


def losses(model: DualARTransformer, batch: Batch, main_ids: torch.Tensor, cfg: DualARTraining,
           guided: bool) -> dict[str, torch.Tensor]:
    drop = cfg.dropout if model.training else 0.0
    out = fwd.slow(model, batch.columns, cfg.guided_layers if guided else (), drop, cfg.compile)
    logits = fwd.main_logits(model, out.normed, main_ids).float()
    target = batch.main_target
    mask = target >= 0
    ce = F.cross_entropy(logits[mask], target[mask], reduction="none")
    is_eos = target[mask] == main_ids.numel() - 1
    w = torch.where(is_eos, torch.full_like(ce, cfg.eos_weight), torch.ones_like(ce))
    result = {"main": (ce * w).sum() / w.sum()}
    # The frame at position p+1 is predicted from position p; its codes are column p+1's rows 1..K.
    fm = batch.frame_mask
    codes = batch.columns[:, 1:, 1:].transpose(1, 2)  # [B, S-1, K]: codes of column p+1 at index p
    sel_codes = codes[fm[:, :-1]]
    fast_logits = fwd.fast(model, out.fast_in[:, :-1][fm[:, :-1]], sel_codes, drop, cfg.compile).float()
    result["fast"] = F.cross_entropy(fast_logits.flatten(0, 1), sel_codes.flatten())
    if guided and out.guided_probs:
        result["guided"] = guided_loss(out.guided_probs, batch.spans, cfg.guided_sigma)
    with torch.no_grad():
        result["eos_acc"] = (logits[mask][is_eos].argmax(-1) == target[mask][is_eos]).float().mean()
        result["c0_acc"] = (logits[mask][~is_eos].argmax(-1) == target[mask][~is_eos]).float().mean()
    return result


def optimizer(model: DualARTransformer, cfg: DualARTraining) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)


def optimize(model: DualARTransformer, opt: torch.optim.Optimizer, batch: Batch, main_ids: torch.Tensor,
             cfg: DualARTraining, guided_scale: float, device: torch.device
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """One training step on `batch` (on `device`): the losses, guided attention weighted by `guided_scale`, one
    clipped optimizer step -> (loss, its parts, the gradient norm before clipping)."""
    with autocast(device):
        parts = losses(model, batch, main_ids, cfg, guided=cfg.guided_weight > 0)
    loss = parts["main"] + parts["fast"] + guided_scale * parts.get("guided", torch.zeros((), device=device))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss, parts, grad


def initial_weights(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Weights to continue from: an exported checkpoint folder (its model.safetensors, read by the server's loader)
    or a state saved by this stage (WORKDIR/dualar_weights)."""
    if path.is_dir():
        from rtts.model.loading import load_model

        loaded = load_model(path, device=device, dtype=torch.float32)
        return {k: v.float() for k, v in loaded.model.state_dict().items()}
    weights: dict[str, torch.Tensor] = state.load(path.parent, path.name, device)["model"]
    return weights


def build(preset: Preset, workdir: Path, device: torch.device) -> tuple[DualARTransformer, dict[str, Any], Path]:
    """Tokenizer + config (written to workdir/dualar/checkpoint) and a freshly initialized model."""
    ckpt = workdir / "dualar" / "checkpoint"
    ckpt.mkdir(parents=True, exist_ok=True)
    ids = write_tokenizer(ckpt, preset.codebook_size)
    cfg_json = config_json(ids, preset.dualar, preset.codebook_size, preset.num_codebooks)
    (ckpt / "config.json").write_text(json.dumps(cfg_json, indent=2) + "\n")
    config = DualARConfig.from_dict(cfg_json)
    tok = load_tokenizer(ckpt, config.model_type)
    model = DualARTransformer(config, tok.semantic_begin_id, tok.semantic_end_id)
    fwd.init_weights(model)
    return model.to(device), cfg_json, ckpt


def train(preset: Preset, workdir: Path, cfg: DualARTraining, device: torch.device, minutes: float = 0.0,
          seed: int = 0, init_weights: Path | None = None) -> Path | None:
    """Train (or resume) until cfg.steps; -> the folder holding config, tokenizer and final weights, or None when the
    time budget ran out first (state saved). `init_weights`: start from weights only (a fresh optimizer)."""
    torch.manual_seed(seed)
    model, _, ckpt = build(preset, workdir, device)
    tok = load_tokenizer(ckpt, "fish_qwen3_omni")
    opt = optimizer(model, cfg)
    step, total, best_val = 0, cfg.steps, float("inf")
    if state.exists(workdir, STATE):
        saved = state.load(workdir, STATE, device)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step, total = int(saved["step"]), int(saved.get("total", cfg.steps))
        best_val = float(saved.get("best_val", best_val))
        print(f"dualar: resumed at step {step} of {total}", flush=True)
    else:
        state.remove(workdir, BEST)  # a previous run's
        if init_weights is not None:
            model.load_state_dict(initial_weights(init_weights, device))
            print(f"dualar: starting from the weights in {init_weights}", flush=True)
    tokens = Tokens.load(workdir / "tokens")
    if tokens.codes.shape[0] != model.config.num_codebooks:
        raise ValueError(f"tokens have {tokens.codes.shape[0]} codebooks, the model {model.config.num_codebooks}")
    builder = PromptBuilder(tok, model.config.num_codebooks, "s2", model.config.codebook_size)
    maker = SequenceMaker(builder, tokens)
    main_ids = main_token_ids(tok).to(device)
    val = Validation.load(workdir / "tokens", builder, device, cfg.batch_positions)
    stream = prefetched(maker, batches(maker, cfg.batch_positions, cfg.max_frames, cfg.multi_turn, seed + step))
    log, deadline = Log(workdir, "dualar"), Deadline(minutes)
    budget = StepBudget(deadline)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"dualar: {n_params / 1e6:.2f} M parameters, {len(tokens.texts)} utterances, step {step}/{cfg.steps}",
          flush=True)

    def save() -> None:
        state.save(workdir, STATE, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                    "total": total, "best_val": best_val})

    def validate() -> None:
        nonlocal best_val
        if val is None:
            return
        v = val.score(model, main_ids, cfg)
        log(step, **{f"val_{k}": round(x, 4) for k, x in v.items()}, utterances=val.utterances)
        if v["main"] < best_val:
            best_val = v["main"]
            state.save(workdir, BEST, {"model": model.state_dict(), "step": step, "val_main": best_val})

    def save_weights() -> None:
        """What export reads: the best held-out weights when validating, else the current ones."""
        weights = model.state_dict()
        if val is not None and state.exists(workdir, BEST):
            best = state.load(workdir, BEST, device)
            if int(best["step"]) != step:
                print(f"dualar: keeping step {best['step']}'s weights (held-out main loss {best['val_main']:.4f})",
                      flush=True)
            weights = best["model"]
        state.save(workdir, WEIGHTS, {"model": weights})

    first, fitting = step, total == cfg.steps  # a resumed run keeps the schedule it was fitted to
    model.train()
    validate()  # the starting point counts: more steps may only make the held-out loss worse
    while step < total:
        fitted = budget.fit(cfg.steps, step, step - first) if fitting else None
        if fitted is not None:
            total = fitted
            print(f"dualar: {budget.per_step:.3f} s per step; training {total} steps", flush=True)
        guided_end = int(cfg.guided_until * total)
        set_lr(opt, cosine_lr(step, total, cfg.warmup, cfg.lr))
        batch = next(stream).to(device)
        g = cfg.guided_weight * max(0.1, 1.0 - step / max(1, guided_end))
        loss, parts, grad = optimize(model, opt, batch, main_ids, cfg, g, device)
        step += 1
        if step % cfg.log_every == 0 or step == total:
            log(step, loss=float(loss.detach()), **{k: float(v.detach()) for k, v in parts.items()},
                grad=float(grad), batch=int(batch.columns.shape[0]), positions=int(batch.columns.shape[-1]),
                seconds=round(deadline.elapsed, 1))
        if step % cfg.val_every == 0 or step == total or deadline.passed:
            validate()
        if step % cfg.save_every == 0 or step == total:
            save()
        if deadline.passed and step < total:
            save()
            save_weights()
            print(f"dualar: time budget reached at step {step}; rerun to resume", flush=True)
            return None
    save_weights()
    return ckpt
