"""Model sizes and training settings per scale: `h200` (the shipped voice) and `micro` (the CPU proof and tests).

Geometry (docs/demo_voice.md): 16 kHz audio, 640 samples per code frame (25 frames per second), one semantic and five
residual codebooks of 1024. flite's audio is 16 kHz, so 44.1 kHz would only add decoder work at rates with no content;
25 Hz keeps more detail than the release's 21.5 Hz (DEMO_VOICE.md measures 20 Hz pooling costing a few WER points).
The server decodes at `codec_config.json`'s rate and resamples to what the client asks for.

Every transformer linear of the h200 DualAR is a multiple of 128 on both sides, so `rtts quantize` (FP8 blocks of
128x128) applies to it and the FP8 gate can run on the demo voice.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SAMPLE_RATE = 16000
FRAME_LENGTH = 640


def _transformer(n_layer: int, dim: int, n_head: int, ffn: int, window: int) -> dict[str, Any]:
    return {"n_layer": n_layer, "dim": dim, "n_head": n_head, "head_dim": dim // n_head, "intermediate_size": ffn,
            "window_size": window, "rope_base": 10000, "norm_eps": 1e-05}


def codec_json(encoder_dim: int, latent: int, decoder_dim: int, codebooks: int, codebook_size: int,
               ffn: int, window: int = 128) -> dict[str, Any]:
    """A `codec_config.json` for the 16 kHz / 640-sample geometry (encoder 2*4*5*8 = 320, one 2x downsample)."""
    enc_out = encoder_dim * 16
    return {
        "sample_rate": SAMPLE_RATE, "frame_length": FRAME_LENGTH, "encoder_dim": encoder_dim,
        "encoder_rates": [2, 4, 5, 8], "latent_dim": latent, "decoder_dim": decoder_dim, "decoder_rates": [8, 5, 4, 2],
        "causal": True, "encoder_transformer": _transformer(1, enc_out, 4, ffn, 512), "decoder_transformer": None,
        "quantizer": {
            "input_dim": latent, "semantic_codebook_size": codebook_size, "n_codebooks": codebooks - 1,
            "codebook_size": codebook_size, "codebook_dim": 8, "downsample_factor": [2],
            "pre_module": _transformer(1, latent, 4, ffn, window),
            "post_module": _transformer(1, latent, 4, ffn, window),
        },
    }


@dataclass(frozen=True)
class DualARSizes:
    dim: int
    n_layer: int
    n_head: int
    n_local_heads: int
    ffn: int
    fast_dim: int
    n_fast_layer: int
    fast_n_head: int
    fast_ffn: int
    max_seq_len: int = 2048


@dataclass(frozen=True)
class CodecTraining:
    steps: int
    batch: int
    segment_frames: int  # crop length in code frames
    lr: float = 1e-3
    warmup: int = 200
    quantizer_dropout: float = 0.5
    mel_weight: float = 15.0
    stft_weight: float = 2.0
    codebook_weight: float = 1.0
    commitment_weight: float = 0.25
    latent_offset_weight: float = 5.0  # keeps z varying with the input (codec_losses.latent_offset_share)
    restart_every: int = 100
    save_every: int = 500
    log_every: int = 50


@dataclass(frozen=True)
class DualARTraining:
    steps: int
    batch_positions: int  # padded positions per batch (batch size x longest sequence)
    lr: float = 1e-3
    warmup: int = 300
    dropout: float = 0.1  # on every residual branch: 24,000 sentences over ~18 epochs overfit without it
    multi_turn: float = 0.4  # share of sequences with 2-3 turns (a live session's conversation layout)
    max_frames: int = 300  # utterances longer than this (12 s) are not trained on
    guided_weight: float = 10.0
    guided_sigma: float = 0.25
    guided_until: float = 0.6  # share of the steps after which the guided-attention weight has decayed to 10%
    guided_layers: tuple[int, ...] = (1, 2)  # the first head of each is pulled onto the text diagonal
    eos_weight: float = 5.0
    val_every: int = 250  # held-out losses (rtts.train.validation); the best weights are the ones exported
    save_every: int = 500
    log_every: int = 50
    compile: bool = False  # transformer blocks through torch.compile (fuses the step's many elementwise kernels)


@dataclass(frozen=True)
class Preset:
    name: str
    codec: dict[str, Any]
    dualar: DualARSizes
    codec_training: CodecTraining
    dualar_training: DualARTraining
    sentences: int  # how many training sentences the data stage speaks (0: all)
    heldout_seconds_cap: float = 12.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_codebooks(self) -> int:
        return 1 + int(self.codec["quantizer"]["n_codebooks"])

    @property
    def codebook_size(self) -> int:
        q = self.codec["quantizer"]
        return max(int(q["codebook_size"]), int(q["semantic_codebook_size"]))


PRESETS: dict[str, Preset] = {
    "h200": Preset(
        name="h200",
        codec=codec_json(encoder_dim=12, latent=128, decoder_dim=320, codebooks=6, codebook_size=1024, ffn=384),
        dualar=DualARSizes(dim=256, n_layer=6, n_head=4, n_local_heads=2, ffn=640,
                           fast_dim=256, n_fast_layer=2, fast_n_head=4, fast_ffn=512),
        codec_training=CodecTraining(steps=12000, batch=48, segment_frames=50),
        dualar_training=DualARTraining(steps=6000, batch_positions=96 * 512),
        sentences=0,  # all of train/sentences.txt.gz (52,311): 24,000 overfit the DualAR (bench/results/demo_voice)
    ),
    "micro": Preset(
        name="micro",
        codec=codec_json(encoder_dim=2, latent=32, decoder_dim=32, codebooks=6, codebook_size=64, ffn=64,
                         window=64),
        dualar=DualARSizes(dim=64, n_layer=3, n_head=4, n_local_heads=2, ffn=128,
                           fast_dim=64, n_fast_layer=1, fast_n_head=4, fast_ffn=128, max_seq_len=1024),
        codec_training=CodecTraining(steps=40, batch=4, segment_frames=25, warmup=5, restart_every=10,
                                     save_every=20, log_every=10),
        dualar_training=DualARTraining(steps=40, batch_positions=8 * 256, warmup=5, save_every=20, log_every=10,
                                       max_frames=200),
        sentences=300,
    ),
}
