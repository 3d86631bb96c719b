"""Losses of the codec: multi-resolution log-mel L1 and multi-resolution STFT (spectral convergence + log magnitude)
for the reconstruction, and the latent-offset penalty that keeps the encoder from collapsing. Without a discriminator
the reconstruction losses get the spectral envelope right, which is what intelligibility needs (DEMO_VOICE.md
section 4); phase detail is left to the decoder's inductive bias.
"""

from __future__ import annotations

import math
from functools import cache

import torch

# (n_fft, hop, mel bins) at 16 kHz: 16 ms to 128 ms windows.
MEL_RESOLUTIONS = ((256, 64, 40), (512, 128, 64), (1024, 256, 80), (2048, 512, 128))
STFT_RESOLUTIONS = ((512, 128), (1024, 256), (2048, 512))


def hz_to_mel(f: torch.Tensor) -> torch.Tensor:
    return 2595.0 * torch.log10(1.0 + f / 700.0)


def mel_to_hz(m: torch.Tensor) -> torch.Tensor:
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


@cache
def mel_filters(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """Triangular HTK-mel filters [n_mels, n_fft // 2 + 1], each normalized to unit area (Slaney-style)."""
    freqs = torch.linspace(0, sample_rate / 2, n_fft // 2 + 1, dtype=torch.float64)
    edges = mel_to_hz(torch.linspace(0.0, float(hz_to_mel(torch.tensor(sample_rate / 2.0))), n_mels + 2,
                                     dtype=torch.float64))
    lo, mid, hi = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    up = (freqs[None] - lo) / (mid - lo)
    down = (hi - freqs[None]) / (hi - mid)
    fb = torch.clamp(torch.minimum(up, down), min=0.0)
    fb = fb * (2.0 / (hi - lo))
    return fb.float()


def magnitude(x: torch.Tensor, n_fft: int, hop: int) -> torch.Tensor:
    """x [B, N] -> |STFT| [B, n_fft/2+1, frames] in float32 (Hann window)."""
    window = torch.hann_window(n_fft, device=x.device)
    spec = torch.stft(x.float(), n_fft, hop, window=window, return_complex=True, center=True)
    return spec.abs().clamp(min=1e-7)


def mel_loss(pred: torch.Tensor, target: torch.Tensor, sample_rate: int) -> torch.Tensor:
    """Mean over resolutions of L1 between log10 mel spectrograms (clamped at 1e-5)."""
    total = pred.new_zeros((), dtype=torch.float32)
    for n_fft, hop, n_mels in MEL_RESOLUTIONS:
        fb = mel_filters(sample_rate, n_fft, n_mels).to(pred.device)
        mp = torch.log10((fb @ magnitude(pred, n_fft, hop)).clamp(min=1e-5))
        mt = torch.log10((fb @ magnitude(target, n_fft, hop)).clamp(min=1e-5))
        total = total + (mp - mt).abs().mean()
    return total / len(MEL_RESOLUTIONS)


def stft_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over resolutions of spectral convergence + L1 of log magnitudes."""
    total = pred.new_zeros((), dtype=torch.float32)
    for n_fft, hop in STFT_RESOLUTIONS:
        sp, st = magnitude(pred, n_fft, hop), magnitude(target, n_fft, hop)
        sc = torch.linalg.vector_norm(st - sp, dim=(1, 2)) / torch.linalg.vector_norm(st, dim=(1, 2)).clamp(min=1e-5)
        total = total + sc.mean() + (sp.log() - st.log()).abs().mean()
    return total / len(STFT_RESOLUTIONS)


def latent_offset_share(z: torch.Tensor) -> torch.Tensor:
    """Share of the latent's energy in its per-channel mean over batch and time: 0 when all of z varies with the
    input, 1 for a constant latent. z [B, C, T].

    Penalized because the codec collapses without it: every Snake adds a positive offset (sin^2 >= 0) that grows with
    its input's power, the encoder's residual stack accumulates these offsets, and the RMSNorms that end the encoder
    transformer and `pre_module` then divide the input-dependent part by an offset-dominated RMS. Early training (the
    output level and average spectrum being fitted) grows those offsets, z becomes nearly constant, the decoder learns
    to ignore it and the quantizers see one direction (most codes unused).
    """
    zf = z.float()
    return zf.mean((0, 2)).pow(2).sum() / zf.pow(2).mean((0, 2)).sum().clamp(min=1e-12)


def snr_db(pred: torch.Tensor, target: torch.Tensor) -> float:
    """Waveform SNR (a phase-sensitive sanity number; GAN-less codecs score low on it)."""
    noise = (pred.float() - target.float()).pow(2).sum()
    return 10.0 * math.log10(float(target.float().pow(2).sum()) / max(float(noise), 1e-12))
