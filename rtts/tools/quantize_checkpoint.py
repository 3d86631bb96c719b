"""`rtts quantize SRC DST`: a checkpoint's copy with FP8 block-scaled transformer linears (the format `model.quant`
defines and loads), written tensor by tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from rtts.kernels import reference
from rtts.model.config import DualARConfig
from rtts.model.loading import iter_checkpoint, weight_files
from rtts.model.quant import QUANT_CONFIG, is_quantized_name, require_blocks
from rtts.tools.random_checkpoint import to_release_key
from rtts.tools.safetensors_writer import write_safetensors


def quantize_checkpoint(src: str | Path, dst: str | Path, progress: bool = True) -> Path:
    """Write DST = SRC with FP8 block-scaled transformer linears (safetensors, tensor by tensor)."""
    src, dst = Path(src), Path(dst)
    config = DualARConfig.from_file(src / "config.json")
    raw_cfg = json.loads((src / "config.json").read_text())
    if raw_cfg.get("quantization"):
        raise ValueError(f"{src} is already quantized")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer, codec, configs: copied unchanged
        if f.is_file() and f not in weight_files(src) and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(f, dst / f.name)
    raw_cfg["quantization"] = QUANT_CONFIG
    (dst / "config.json").write_text(json.dumps(raw_cfg, indent=2))

    entries = {e.name: e for e in iter_checkpoint(src, config)}
    specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for name, e in entries.items():
        out_name = to_release_key(name, config.format)
        if is_quantized_name(name):
            n, k = e.shape
            require_blocks(name, n, k)
            specs.append((out_name, (n, k), reference.FP8))
            specs.append((out_name + "_scale", (n // 128, k // 128), torch.float32))
        else:  # the FP8 serving path runs everything else in bf16
            specs.append((out_name, e.shape, torch.bfloat16))
    back = {to_release_key(n, config.format): n for n in entries}
    cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def make(out_name: str) -> torch.Tensor:
        if out_name.endswith(".weight_scale"):
            q_s = cache.pop(out_name[: -len("_scale")])
            return q_s[1]
        name = back[out_name]
        t = entries[name].load()
        if is_quantized_name(name):
            q, s = reference.quantize_weight(t)
            cache[out_name] = (q, s)
            return q
        return t.to(torch.bfloat16)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc="quantizing", unit="tensor")
    fname = "model.safetensors"
    write_safetensors(dst / fname, specs, make, on_tensor=lambda n: bar.update(1) if bar is not None else None)
    if bar is not None:
        bar.close()
    return dst
