"""Load a DualAR checkpoint directory (S2-Pro safetensors or S1-mini model.pth) onto a meta-built model.

The model is built on the meta device and every parameter is assigned straight from the file, tensor by tensor, so a
4B checkpoint needs one copy of its weights in RAM, not two. Loading is strict: a missing tensor, a wrong shape, an
unexpected tensor, an unknown model_type or a tokenizer that disagrees with the config raise `CheckpointError` naming
the file and the tensor. Never a silent partial load.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rtts.model.config import DualARConfig
from rtts.model.dual_ar import DualARTransformer
from rtts.model.errors import CheckpointError
from rtts.model.quant import convert_to_fp8, finish_fp8
from rtts.model.tokenizer import FishTokenizer, load_tokenizer

# Buffers some exports carry; they are recomputed, never loaded.
_STALE = re.compile(r"(^|\.)(freqs_cis|fast_freqs_cis|causal_mask)$")


@dataclass
class LoadedModel:
    config: DualARConfig
    model: DualARTransformer
    tokenizer: FishTokenizer
    checkpoint_dir: Path


@dataclass(frozen=True)
class _Entry:
    name: str  # internal (remapped) name
    source_name: str  # name in the file
    file: Path
    shape: tuple[int, ...]
    nbytes: int
    load: Callable[[], torch.Tensor]


def remap_s2_key(key: str) -> str:
    """Release (HF) names of `fish_qwen3_omni` -> internal names."""
    if key.startswith("text_model.model."):
        return key[len("text_model.model."):]
    if key == "audio_decoder.codebook_embeddings.weight":
        return "codebook_embeddings.weight"
    if key.startswith("audio_decoder."):
        return "fast_" + key[len("audio_decoder."):]
    return key


def weight_files(checkpoint_dir: Path) -> list[Path]:
    """The LLM weight files, in the reference's priority: sharded safetensors, model.safetensors, model.pth."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(index, f"unreadable shard index: {e}") from None
        files = sorted({checkpoint_dir / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f, "shard listed in model.safetensors.index.json is missing")
        return files
    for name in ("model.safetensors", "model.pth"):
        if (checkpoint_dir / name).exists():
            return [checkpoint_dir / name]
    raise CheckpointError(checkpoint_dir, "no weights found (expected model.safetensors[.index.json] or model.pth)")


def _safetensors_entries(path: Path, remap: Callable[[str], str]) -> Iterator[_Entry]:
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        keys = list(handle.keys())
    except Exception as e:  # safetensors raises its own error types for truncated or garbage files
        raise CheckpointError(path, f"unreadable safetensors file: {e}") from None
    for key in keys:
        sl = handle.get_slice(key)
        shape = tuple(sl.get_shape())
        nbytes = math.prod(shape) * _dtype_size(sl.get_dtype())

        def load(key: str = key) -> torch.Tensor:
            try:
                return handle.get_tensor(key)
            except Exception as e:
                raise CheckpointError(path, f"cannot read tensor: {e}", tensor=key) from None

        yield _Entry(remap(key), key, path, shape, nbytes, load)


def _pth_entries(path: Path) -> Iterator[_Entry]:
    try:
        # mmap keeps a multi-GB .pth out of RAM until each tensor is touched.
        sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(path, f"unreadable PyTorch checkpoint: {e}") from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]
    if not isinstance(sd, dict):
        raise CheckpointError(path, "expected a dict of tensors")
    for key, t in sd.items():
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(path, f"entry is a {type(t).__name__}, not a tensor", tensor=str(key))
        name = key[len("model."):] if key.startswith("model.") else key
        if "audio_" in name:  # the reference drops these (dead audio-projector path)
            continue
        yield _Entry(name, key, path, tuple(t.shape), t.numel() * t.element_size(), _constant(t))


def _constant(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: t


def iter_checkpoint(checkpoint_dir: Path, config: DualARConfig) -> Iterator[_Entry]:
    for f in weight_files(checkpoint_dir):
        if f.suffix == ".safetensors":
            remap = remap_s2_key if config.format == "s2" else (lambda k: k)
            yield from _safetensors_entries(f, remap)
        else:
            yield from _pth_entries(f)


def _dtype_size(name: str) -> int:
    return {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
            "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}.get(name, 4)


def check_tokenizer(config: DualARConfig, tok: FishTokenizer, source: Path) -> None:
    """The tokenizer decides the semantic range (as in the reference); it must agree with the config."""
    def bad(msg: str) -> CheckpointError:
        return CheckpointError(source, f"tokenizer disagrees with config.json: {msg}")

    if config.semantic_start_token_id is not None and config.semantic_start_token_id != tok.semantic_begin_id:
        raise bad(f"semantic_start_token_id {config.semantic_start_token_id} != tokenizer <|semantic:0|> "
                  f"{tok.semantic_begin_id}")
    if config.semantic_end_token_id is not None and config.semantic_end_token_id != tok.semantic_end_id:
        raise bad(f"semantic_end_token_id {config.semantic_end_token_id} != tokenizer last semantic "
                  f"{tok.semantic_end_id}")
    if config.eos_token_id is not None and config.eos_token_id != tok.im_end_id:
        raise bad(f"eos_token_id {config.eos_token_id} != tokenizer <|im_end|> {tok.im_end_id}")
    if tok.num_tokens > config.vocab_size:
        raise bad(f"tokenizer has ids up to {tok.num_tokens - 1} but vocab_size is {config.vocab_size}")
    if tok.num_semantic > config.codebook_size:
        raise bad(f"{tok.num_semantic} semantic tokens but codebook_size is {config.codebook_size}")


def load_model(
    checkpoint_dir: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool | None = None,
) -> LoadedModel:
    """Read config + tokenizer + weights of a checkpoint directory into an eval-mode model on `device`."""
    ckpt = Path(checkpoint_dir)
    if not ckpt.is_dir():
        raise CheckpointError(ckpt, "checkpoint directory not found")
    config = DualARConfig.from_file(ckpt / "config.json")
    tokenizer = load_tokenizer(ckpt, config.model_type)
    check_tokenizer(config, tokenizer, Path(tokenizer.path))

    with torch.device("meta"):
        model = DualARTransformer(config, tokenizer.semantic_begin_id, tokenizer.semantic_end_id)
    if config.quantization == "fp8_block":
        convert_to_fp8(model)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}

    entries: dict[str, _Entry] = {}
    fused: dict[str, dict[str, _Entry]] = {}
    for e in iter_checkpoint(ckpt, config):
        if _STALE.search(e.name):
            continue
        m = re.match(r"^(.*\.attention)\.(wq|wk|wv)\.(weight|bias)$", e.name)
        if m:  # separate q/k/v projections: fused into wqkv below, like the reference's load hook
            fused.setdefault(f"{m.group(1)}.wqkv.{m.group(3)}", {})[m.group(2)] = e
            continue
        if e.name in entries:
            raise CheckpointError(e.file, "tensor appears twice in the checkpoint", tensor=e.source_name)
        entries[e.name] = e

    for name in sorted(set(entries) - set(expected)):
        e = entries[name]
        raise CheckpointError(e.file, f"unexpected tensor (no such parameter in a {config.model_type} model with this "
                              "config)", tensor=e.source_name)
    wfiles = weight_files(ckpt)
    src = wfiles[0] if len(wfiles) == 1 else ckpt / "model.safetensors.index.json"
    for name in expected:
        if name not in entries and name not in fused:
            raise CheckpointError(src, f"missing tensor (expected shape {list(expected[name])})",
                                  tensor=name)

    total = sum(e.nbytes for e in entries.values()) + sum(x.nbytes for d in fused.values() for x in d.values())
    show = progress if progress is not None else total > (512 << 20)
    bar = _progress(total, show, f"loading {ckpt.name}")
    try:
        for name, e in entries.items():
            if e.shape != expected[name]:
                raise CheckpointError(e.file, f"shape {list(e.shape)} but the config expects {list(expected[name])}",
                                      tensor=e.source_name)
            _assign(model, name, e.load(), device, dtype)
            bar(e.nbytes)
        for name, parts in fused.items():
            if set(parts) != {"wq", "wk", "wv"}:
                raise CheckpointError(ckpt, f"incomplete separate q/k/v projections: have {sorted(parts)}", tensor=name)
            t = torch.cat([parts["wq"].load(), parts["wk"].load(), parts["wv"].load()], dim=0)
            if tuple(t.shape) != expected[name]:
                raise CheckpointError(parts["wq"].file, f"fused q/k/v shape {list(t.shape)} != {list(expected[name])}",
                                      tensor=name)
            _assign(model, name, t, device, dtype)
            bar(sum(p.nbytes for p in parts.values()))
    finally:
        bar(None)
    if config.quantization == "fp8_block":
        finish_fp8(model)
    model.eval().requires_grad_(False)
    return LoadedModel(config, model, tokenizer, ckpt)


def _assign(model: nn.Module, name: str, t: torch.Tensor, device: torch.device | str, dtype: torch.dtype) -> None:
    *path, leaf = name.split(".")
    mod = model.get_submodule(".".join(path))
    # FP8 weights and their float32 block scales keep their dtype; everything else takes the requested one.
    keep = t.dtype == torch.float8_e4m3fn or leaf == "weight_scale" or not t.is_floating_point()
    t = t.to(device=device, dtype=t.dtype if keep else dtype)
    if t.data_ptr() != 0 and not t.is_contiguous():
        t = t.contiguous()
    mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)


def _progress(total: int, show: bool, desc: str) -> Callable[[int | None], None]:
    """A byte-count progress bar (tqdm) for large loads; a no-op for small ones. Call with None to close."""
    if not show:
        return lambda n: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)

    def step(n: int | None) -> None:
        if n is None:
            bar.close()
        else:
            bar.update(n)

    return step
