"""Codec stage: train the server's `Codec` class (sizes from the preset's codec_config.json) on random crops.

Forward = the serving encode path up to the quantizer (encoder, downsample, pre_module), the training quantizer of
`vq.py`, then the serving decode path (post_module, upsample, decoder). Losses: multi-resolution mel L1 and STFT
(codec_losses.py), codebook/commitment, and the latent-offset penalty on the quantizer's input (without it the encoder
collapses to a near-constant latent: `codec_losses.latent_offset_share`). All audio sits on the device; crops are
cut there. Checkpoints every `save_every` steps and when the wall-clock budget runs out; a rerun resumes from the last
one. The finished codec is written as codec.pth + codec_config.json (what the tokens and export stages read, through
the server's loader).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from rtts.model.codec import Codec
from rtts.train import codec_io, state
from rtts.train.codec_losses import latent_offset_share, mel_loss, snr_db, stft_loss
from rtts.train.dataset import Store
from rtts.train.loop import Deadline, Log, StepBudget, autocast, cosine_lr, set_lr
from rtts.train.presets import CodecTraining
from rtts.train.vq import CodeUsage, VQResult, quantize

STATE = "codec_state"


class Crops:
    """Random fixed-length crops of the store's utterances, cut on the device (zero-padded past an utterance's end)."""

    def __init__(self, store: Store, device: torch.device, seed: int) -> None:
        self.audio = torch.from_numpy(np.array(store.audio)).to(device)  # int16 on the device
        self.offsets = torch.tensor([u.offset for u in store.utts], device=device)
        self.lengths = torch.tensor([u.length for u in store.utts], device=device)
        self.weights = self.lengths.float() / self.lengths.sum()
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def batch(self, n: int, length: int) -> torch.Tensor:
        """-> [n, length] float32 in [-1, 1]."""
        dev = self.audio.device
        idx = torch.multinomial(self.weights, n, replacement=True, generator=self.gen)
        room = (self.lengths[idx] - length).clamp(min=0)
        start = (torch.rand(n, device=dev, generator=self.gen) * (room + 1).float()).long().clamp(max=room)
        pos = start[:, None] + torch.arange(length, device=dev)[None]
        inside = pos < self.lengths[idx, None]
        samples = self.audio[(self.offsets[idx, None] + pos).clamp(max=self.audio.numel() - 1)]
        return torch.where(inside, samples.float() / 32768.0, torch.zeros((), device=dev))


def forward(codec: Codec, x: torch.Tensor, dropout: float) -> tuple[torch.Tensor, VQResult, torch.Tensor]:
    """x [B, N] (N a multiple of frame_length) -> (reconstruction [B, N], VQResult, quantizer input [B, latent, T])."""
    q = codec.quantizer
    z = q.pre_module(q.downsample(codec.encoder(x[:, None])))
    vq = quantize(q, z.float(), dropout)
    y = codec.decoder(q.upsample(q.post_module(vq.z_q)))[:, 0]
    return y, vq, z


def train(store: Store, workdir: Path, codec_json: dict[str, Any], cfg: CodecTraining, device: torch.device,
          minutes: float = 0.0, seed: int = 0) -> Path | None:
    """Train (or resume) until cfg.steps (or what fits the time budget); -> the codec folder when finished, None when
    the budget ran out first (the state is saved and the codec so far written)."""
    torch.manual_seed(seed)
    if device.type == "cuda":  # fixed crop shapes: let cuDNN pick its fastest convolutions once
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    config = codec_io.config_from_json(codec_json, workdir)
    codec = codec_io.new_codec(config, seed).to(device)
    opt = torch.optim.AdamW(codec.parameters(), lr=cfg.lr, betas=(0.8, 0.99), weight_decay=0.0)
    step, total = 0, cfg.steps
    if state.exists(workdir, STATE):
        saved = state.load(workdir, STATE, device)
        codec.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        step, total = int(saved["step"]), int(saved.get("total", cfg.steps))
        print(f"codec: resumed at step {step} of {total}", flush=True)
    first, fitting = step, total == cfg.steps  # a resumed run keeps the schedule it was fitted to
    crops = Crops(store, device, seed + step)
    usage = CodeUsage(codec.quantizer)
    log, deadline = Log(workdir, "codec"), Deadline(minutes)
    budget = StepBudget(deadline)
    length = cfg.segment_frames * config.frame_length
    n_params = sum(p.numel() for p in codec.parameters())
    print(f"codec: {n_params / 1e6:.2f} M parameters, {store.seconds / 3600:.2f} h of audio, step {step}/{cfg.steps}",
          flush=True)

    def save() -> None:
        state.save(workdir, STATE, {"model": codec.state_dict(), "optimizer": opt.state_dict(), "step": step,
                                    "total": total})

    while step < total:
        fitted = budget.fit(cfg.steps, step, step - first) if fitting else None
        if fitted is not None:
            total = fitted
            print(f"codec: {budget.per_step:.3f} s per step; training {total} steps", flush=True)
        set_lr(opt, cosine_lr(step, total, cfg.warmup, cfg.lr))
        x = crops.batch(cfg.batch, length)
        with autocast(device):
            y, vq, z = forward(codec, x, cfg.quantizer_dropout)
        mel = mel_loss(y.float(), x, config.sample_rate)
        stft = stft_loss(y.float(), x)
        offset = latent_offset_share(z)
        loss = (cfg.mel_weight * mel + cfg.stft_weight * stft + cfg.codebook_weight * vq.codebook_loss
                + cfg.commitment_weight * vq.commitment_loss + cfg.latent_offset_weight * offset)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(codec.parameters(), 1.0)
        opt.step()
        usage.update(vq.codes)
        step += 1
        logging = step % cfg.log_every == 0 or step == total
        used = sum(usage.utilization()) / len(usage.counts) if logging else 0.0  # codes used since the last restart
        restarted = usage.restart(vq.encodings) if step % cfg.restart_every == 0 else None
        if logging:
            log(step, loss=float(loss.detach()), mel=float(mel.detach()), stft=float(stft.detach()),
                vq=float(vq.codebook_loss.detach()), offset=float(offset.detach()),
                snr=snr_db(y.detach(), x), grad=float(grad), used=round(used, 4),
                restarted=restarted if restarted is not None else -1, seconds=round(deadline.elapsed, 1))
        if step % cfg.save_every == 0 or step == total:
            save()
        if deadline.passed and step < total:
            save()
            write(codec, workdir, codec_json)  # usable as it is; a rerun resumes and overwrites it
            print(f"codec: time budget reached at step {step}; rerun to resume", flush=True)
            return None
    return write(codec, workdir, codec_json)


def write(codec: Codec, workdir: Path, codec_json: dict[str, Any]) -> Path:
    """The codec as the server reads it (a copy: training may go on with the original)."""
    import copy

    frozen = copy.deepcopy(codec).cpu().eval().requires_grad_(False)
    return codec_io.write_codec(frozen, workdir / "codec", codec_json).parent
