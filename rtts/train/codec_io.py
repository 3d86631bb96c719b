"""A trained codec <-> the on-disk layout `rtts.model.codec.load_codec` reads (`codec.pth` + `codec_config.json`).

The serving classes hold plain (fused) conv weights. The release layout stores the weight-normed ones as a (g, v)
pair: the causal convs as `parametrizations.weight.original0/1`, the VQ projections as `weight_g/weight_v`. Writing
v = W and g = ||W|| (norm over every dim but the first) makes the loader's fusion g * v / ||v|| give W back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rtts.model.codec import Codec, CodecConfig, codec_from_state_dict, codec_state_dict_keys, random_codec_state_dict
from rtts.model.codec_conv import CausalConv1d, CausalConvTranspose1d
from rtts.model.codec_layers import VectorQuantizer

_PARAM = (".parametrizations.weight.original0", ".parametrizations.weight.original1")
_LEGACY = (".weight_g", ".weight_v")


def config_from_json(raw: dict[str, Any], workdir: Path) -> CodecConfig:
    """Parse a codec_config.json dict through the server's own reader (writes it to workdir/codec_config.json)."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "codec_config.json"
    path.write_text(json.dumps(raw, indent=2) + "\n")
    return CodecConfig.from_json(path)


def new_codec(config: CodecConfig, seed: int = 0) -> Codec:
    """A trainable codec with the random-checkpoint init (scales that keep activations O(1) through the stack)."""
    codec = codec_from_state_dict(random_codec_state_dict(config, seed=seed), config)
    return codec.train().requires_grad_(True)


def weight_norm_spelling(codec: Codec) -> dict[str, tuple[str, str]]:
    """Fused weight key -> the (g, v) suffixes its on-disk pair uses."""
    out: dict[str, tuple[str, str]] = {}
    for name, module in codec.named_modules():
        if isinstance(module, (CausalConv1d, CausalConvTranspose1d)) and module.weight_norm:
            out[f"{name}.conv.weight"] = _PARAM
        elif isinstance(module, VectorQuantizer):
            out[f"{name}.in_proj.weight"] = _LEGACY
            out[f"{name}.out_proj.weight"] = _LEGACY
    return out


def disk_state_dict(codec: Codec, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The codec's weights in the release layout, cast to `dtype` (the server loads them in float32)."""
    spelling = weight_norm_spelling(codec)
    out: dict[str, torch.Tensor] = {}
    for key, tensor in codec.state_dict().items():
        w = tensor.detach().float().cpu()
        if key in spelling:
            stem = key[: -len(".weight")]
            g = torch.linalg.vector_norm(w.flatten(1), dim=1).view(-1, *([1] * (w.ndim - 1)))
            out[stem + spelling[key][0]] = g.to(dtype)
            out[stem + spelling[key][1]] = w.to(dtype)
        else:
            out[key] = w.to(dtype)
    expected = codec_state_dict_keys(codec.config)
    if set(out) != set(expected):
        raise AssertionError(f"codec layout mismatch: {sorted(set(out) ^ set(expected))[:5]}")
    return out


def write_codec(codec: Codec, out_dir: Path, config_json: dict[str, Any], dtype: torch.dtype = torch.float16) -> Path:
    """codec.pth + codec_config.json into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.save(disk_state_dict(codec, dtype), out_dir / "codec.pth")
    (out_dir / "codec_config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    return out_dir / "codec.pth"
