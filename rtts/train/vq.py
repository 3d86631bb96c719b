"""Training-time quantization for the server's `DownsampleQuantizer` (rtts/model/codec_layers.py), without touching it.

The serving `VectorQuantizer.quantize` reproduces the reference's inference arithmetic, `z_e + (z_q - z_e)`, which is
z_q in value but passes no gradient to the encoder (the two z_e terms cancel). Training needs the DAC recipe instead:
- the same lookup (cosine nearest code, raw codebook row as z_q), so trained codes mean at inference what they meant
  in training;
- a straight-through estimator `z_e + (z_q - z_e).detach()`, so the reconstruction loss reaches the encoder;
- codebook loss |z_q - sg(z_e)|^2 and commitment loss |z_e - sg(z_q)|^2;
- quantizer dropout: each example keeps a random number of residual codebooks, so early codebooks carry the most;
- dead-code restart: codes unused for a while are moved onto recent encoder outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rtts.model.codec_layers import DownsampleQuantizer, VectorQuantizer


@dataclass
class VQResult:
    z_q: torch.Tensor  # [B, latent, T] sum of the kept quantizers' outputs
    codes: torch.Tensor  # [B, num_codebooks, T]
    codebook_loss: torch.Tensor
    commitment_loss: torch.Tensor
    encodings: list[torch.Tensor]  # per quantizer [B*T, codebook_dim] (detached), for dead-code restart


def lookup(vq: VectorQuantizer, z_e: torch.Tensor) -> torch.Tensor:
    """Nearest code by cosine similarity, as the serving quantizer picks it. z_e [B, d, T] -> codes [B, T]."""
    enc = F.normalize(z_e.detach().float().transpose(1, 2).flatten(0, 1))
    book = F.normalize(vq.codebook.weight.detach().float())
    return torch.argmax(enc @ book.t(), dim=1).view(z_e.shape[0], z_e.shape[-1])


def quantize_one(vq: VectorQuantizer, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor, torch.Tensor]:
    """-> (out [B, latent, T] with straight-through gradient, codes [B, T], codebook loss [B, T], commitment loss
    [B, T], z_e [B, d, T])."""
    z_e = vq.in_proj(residual)
    codes = lookup(vq, z_e)
    z_q = vq.codebook(codes).transpose(1, 2).to(z_e.dtype)
    codebook = (z_q - z_e.detach()).float().pow(2).mean(1)
    commitment = (z_e - z_q.detach()).float().pow(2).mean(1)
    z_st = z_e + (z_q - z_e).detach()
    return vq.out_proj(z_st), codes, codebook, commitment, z_e


def quantize(q: DownsampleQuantizer, z: torch.Tensor, dropout: float) -> VQResult:
    """The semantic quantizer, then the residual ones on what it leaves, as `DownsampleQuantizer.quantize` does.
    With probability `dropout` an example keeps only the first 1..n residual codebooks (chosen uniformly)."""
    vqs = [*q.semantic_quantizer.quantizers, *q.quantizer.quantizers]
    B, _, T = z.shape
    n = len(vqs)
    keep = torch.full((B,), n, device=z.device)
    if dropout > 0:
        drop = torch.rand(B, device=z.device) < dropout
        keep = torch.where(drop, torch.randint(1, n + 1, (B,), device=z.device), keep)
    residual, total = z, torch.zeros_like(z)
    codes, cb_losses, commit_losses, encodings = [], [], [], []
    for i, vq in enumerate(vqs):
        assert isinstance(vq, VectorQuantizer)
        out, c, cb, cm, z_e = quantize_one(vq, residual)
        mask = (keep > i).to(z.dtype)[:, None, None]
        total = total + out * mask
        residual = residual - out * mask
        codes.append(c)
        weight = mask[:, 0]  # [B, 1]: dropped quantizers have no loss either
        cb_losses.append((cb * weight).sum() / (weight.sum() * T).clamp(min=1))
        commit_losses.append((cm * weight).sum() / (weight.sum() * T).clamp(min=1))
        encodings.append(z_e.detach().float().transpose(1, 2).flatten(0, 1))
    return VQResult(total, torch.stack(codes, dim=1), torch.stack(cb_losses).sum(), torch.stack(commit_losses).sum(),
                    encodings)


class CodeUsage:
    """Counts code use per quantizer; `restart` moves codes unused since the last restart onto random encodings."""

    def __init__(self, q: DownsampleQuantizer) -> None:
        self.vqs = [*q.semantic_quantizer.quantizers, *q.quantizer.quantizers]
        self.counts = [torch.zeros(vq.codebook.num_embeddings, device=vq.codebook.weight.device) for vq in self.vqs]

    def update(self, codes: torch.Tensor) -> None:
        for i, count in enumerate(self.counts):
            count += torch.bincount(codes[:, i].flatten(), minlength=count.numel()).to(count.dtype)

    @torch.no_grad()
    def restart(self, encodings: list[torch.Tensor]) -> int:
        """-> how many codes were restarted; counts start over."""
        moved = 0
        for vq, count, enc in zip(self.vqs, self.counts, encodings):
            dead = (count == 0).nonzero().flatten()
            if dead.numel() and enc.shape[0]:
                pick = torch.randint(0, enc.shape[0], (dead.numel(),), device=enc.device)
                fresh = enc[pick] + 1e-3 * torch.randn_like(enc[pick])
                vq.codebook.weight[dead] = fresh.to(vq.codebook.weight.dtype)
                moved += dead.numel()
            count.zero_()
        return moved

    def utilization(self) -> list[float]:
        return [float((c > 0).float().mean()) for c in self.counts]
