"""`rtts make-random-checkpoint`: random weights in the exact release layout, for benchmarks and tests.

Presets:
- `s2-pro`: `fish_qwen3_omni` with the S2-Pro shapes (4.56 B params, bf16 by default), two safetensors shards + index,
  a Qwen-sized `tokenizer.json` with the release's special ids, and a release-shaped `codec.pth`. The LLM is written
  tensor by tensor, so RAM never holds two copies (or even one copy of the whole model).
- `s1-mini`: `dual_ar` with the S1-mini shapes, `model.pth`, tiktoken files, release codec.
- `tiny`: a small S2-format model and codec (sizes like the golden tiny set), fast on a CPU: tests, and
  `rtts serve --random-preset tiny`. Random weights produce noise, not speech.

Everything is deterministic for a seed: the same preset and seed give the same bytes.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rtts.model.codec import Codec, CodecConfig, codec_from_state_dict, random_codec_state_dict
from rtts.model.config import S1_MINI_CONFIG_JSON, S2_PRO_CONFIG_JSON, DualARConfig
from rtts.model.dual_ar import DualARTransformer
from rtts.model.loading import LoadedModel
from rtts.model.tokenizer import load_tokenizer
from rtts.tools.random_tokenizer import write_s1_tokenizer, write_s2_tokenizer
from rtts.tools.safetensors_writer import write_safetensors

PRESETS = ("s2-pro", "s1-mini", "tiny")
SHARD_BYTES = 5 << 30  # the release splits its ~9 GB into two shards

TINY_CONFIG_JSON: dict[str, Any] = {
    "model_type": "fish_qwen3_omni",
    "dtype": "float32",
    "eos_token_id": 413,
    "pad_token_id": 437,
    "audio_pad_token_id": 445,
    "semantic_start_token_id": 446,
    "semantic_end_token_id": 509,
    "text_config": {
        "model_type": "fish_qwen3", "vocab_size": 512, "n_layer": 2, "n_head": 4, "n_local_heads": 2, "head_dim": 16,
        "dim": 64, "intermediate_size": 128, "rope_base": 1000000.0, "norm_eps": 1e-06, "max_seq_len": 4096,
        "tie_word_embeddings": True, "attention_qkv_bias": False, "attention_o_bias": False,
        "attention_qk_norm": True,
    },
    "audio_decoder_config": {
        "model_type": "fish_qwen3_audio_decoder", "vocab_size": 64, "n_layer": 2, "n_head": 4, "n_local_heads": 2,
        "head_dim": 16, "dim": 64, "intermediate_size": 128, "attention_qkv_bias": False, "attention_o_bias": False,
        "attention_qk_norm": False, "num_codebooks": 10,
    },
}

TINY_CODEC_JSON: dict[str, Any] = {
    "sample_rate": 44100, "frame_length": 2048, "encoder_dim": 4, "encoder_rates": [2, 4, 8, 8], "latent_dim": 64,
    "decoder_dim": 64, "decoder_rates": [8, 8, 4, 2], "causal": True,
    "encoder_transformer": {"n_layer": 1, "dim": 64, "n_head": 1, "head_dim": 64, "intermediate_size": 192,
                            "window_size": 512, "rope_base": 10000, "norm_eps": 1e-05},
    "decoder_transformer": None,
    "quantizer": {
        "input_dim": 64, "semantic_codebook_size": 64, "n_codebooks": 9, "codebook_size": 32, "codebook_dim": 8,
        "downsample_factor": [2, 2],
        "pre_module": {"n_layer": 2, "dim": 64, "n_head": 4, "head_dim": 16, "intermediate_size": 192,
                       "window_size": 128, "rope_base": 10000, "norm_eps": 1e-05},
        "post_module": {"n_layer": 2, "dim": 64, "n_head": 4, "head_dim": 16, "intermediate_size": 192,
                        "window_size": 128, "rope_base": 10000, "norm_eps": 1e-05},
    },
}


_PRESET_CONFIGS = {"s2-pro": S2_PRO_CONFIG_JSON, "s1-mini": S1_MINI_CONFIG_JSON, "tiny": TINY_CONFIG_JSON}


def to_release_key(name: str, model_format: str) -> str:
    """Internal parameter name -> the name the release file uses (inverse of loading.remap_s2_key)."""
    if model_format != "s2":
        return name
    if name == "codebook_embeddings.weight":
        return "audio_decoder.codebook_embeddings.weight"
    if name.startswith("fast_"):
        return "audio_decoder." + name[len("fast_"):]
    return "text_model.model." + name


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, std: float = 0.02) -> torch.Tensor:
    """The init rule of every random preset, on the generator's device (float32)."""
    if name.endswith("norm.weight"):
        # Around 1 (not exactly 1) so a dropped norm weight changes the output.
        return 1.0 + 0.05 * torch.randn(shape, generator=gen, device=gen.device)
    if name.endswith(".bias"):
        return torch.zeros(shape, device=gen.device)
    return std * torch.randn(shape, generator=gen, device=gen.device)


def _tensor_maker(config: DualARConfig, dtype: torch.dtype, seed: int, std: float) -> Callable[[str], torch.Tensor]:
    """Each tensor is drawn from its own generator (seed, name), so shards can be written in any order."""

    def make(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return random_tensor(name, shape, g, std).to(dtype)

    shapes = parameter_shapes(config)
    return lambda name: make(name, shapes[name])


def parameter_shapes(config: DualARConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        m = DualARTransformer(config, 0, 0)
    return {k: tuple(v.shape) for k, v in m.state_dict().items()}


def _write_llm_safetensors(out: Path, config: DualARConfig, dtype: torch.dtype, seed: int,
                           progress: Callable[[int], None]) -> None:
    make = _tensor_maker(config, dtype, seed, std=0.02)
    shapes = parameter_shapes(config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * itemsize
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for fname, names in zip(files, shards):
        release = {to_release_key(n, "s2"): n for n in names}
        specs = [(r, shapes[n], dtype) for r, n in release.items()]
        total += write_safetensors(out / fname, specs, lambda r: make(release[r]), on_tensor=progress)
        weight_map.update({r: fname for r in release})
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _write_llm_pth(out: Path, config: DualARConfig, dtype: torch.dtype, seed: int,
                   progress: Callable[[int], None]) -> None:
    make = _tensor_maker(config, dtype, seed, std=0.02)
    sd = {}
    for name in parameter_shapes(config):
        sd[name] = make(name)
        progress(sd[name].numel() * sd[name].element_size())
    torch.save(sd, out / "model.pth")


def make_random_checkpoint(
    preset: str,
    out_dir: str | Path,
    seed: int = 0,
    dtype: torch.dtype | None = None,
    progress: bool = True,
) -> Path:
    _check_preset(preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg_json = _PRESET_CONFIGS[preset]
    dtype = dtype or (torch.float32 if preset == "tiny" else torch.bfloat16)
    cfg_json = dict(cfg_json, dtype={torch.bfloat16: "bfloat16", torch.float32: "float32",
                                     torch.float16: "float16"}[dtype]) if "text_config" in cfg_json else cfg_json
    config = DualARConfig.from_dict(cfg_json)
    (out / "config.json").write_text(json.dumps(cfg_json, indent=2))
    write_tokenizer(out, config)

    bar = _bar(_llm_bytes(config, dtype), progress, f"writing {preset}")
    try:
        if config.format == "s2":
            _write_llm_safetensors(out, config, dtype, seed, bar)
        else:
            _write_llm_pth(out, config, dtype, seed, bar)
    finally:
        bar(None)

    torch.save(random_codec_state_dict(codec_config_for(preset, out), seed=seed), out / "codec.pth")
    return out


def write_tokenizer(out: Path, config: DualARConfig) -> None:
    """Tokenizer files with the release's special-token layout for this config's ids."""
    if config.format == "s2":
        num_semantic = (config.semantic_end_token_id or 0) - (config.semantic_start_token_id or 0) + 1
        base = (config.eos_token_id or 2) - 2  # <|endoftext|>, <|im_start|>, <|im_end|> follow the base vocab
        write_s2_tokenizer(out, num_base_tokens=base, vocab_size=config.vocab_size, num_semantic=num_semantic)
    else:
        write_s1_tokenizer(out, num_ranks=151643, num_semantic=config.codebook_size)


def codec_config_for(preset: str, out: Path) -> CodecConfig:
    """The release codec for the release presets; the tiny codec (its codec_config.json written to `out`) else."""
    if preset != "tiny":
        return CodecConfig.release()
    (out / "codec_config.json").write_text(json.dumps(TINY_CODEC_JSON, indent=2))
    return CodecConfig.from_json(out / "codec_config.json")


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (choose from {', '.join(PRESETS)})")


def _llm_bytes(config: DualARConfig, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(math.prod(s) for s in parameter_shapes(config).values()) * itemsize


def _bar(total: int, show: bool, desc: str) -> Callable[[int | None], None]:
    if not show or total < (256 << 20):
        return lambda n: None
    from tqdm import tqdm

    bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)
    return lambda n: bar.close() if n is None else bar.update(n)


def random_model(
    preset: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    workdir: str | Path | None = None,
    codec_dtype: torch.dtype = torch.float32,
) -> tuple[LoadedModel, Codec]:
    """A preset's exact shapes with random weights built straight on `device` (no checkpoint files for the
    weights; only the small tokenizer files are written, to `workdir` or a temporary folder). For benchmarks."""
    import tempfile

    _check_preset(preset)
    out = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix=f"rtts-{preset}-"))
    out.mkdir(parents=True, exist_ok=True)
    cfg_json = _PRESET_CONFIGS[preset]
    config = DualARConfig.from_dict(cfg_json)
    (out / "config.json").write_text(json.dumps(cfg_json))
    write_tokenizer(out, config)
    tokenizer = load_tokenizer(out, config.model_type)
    with torch.device("meta"):
        model = DualARTransformer(config, tokenizer.semantic_begin_id, tokenizer.semantic_end_id)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(model.named_parameters()):
        owner, leaf = name.rsplit(".", 1)
        t = random_tensor(name, tuple(p.shape), gen)
        model.get_submodule(owner)._parameters[leaf] = torch.nn.Parameter(t.to(dtype), requires_grad=False)
    model.eval()
    codec_cfg = codec_config_for(preset, out)
    codec = codec_from_state_dict(random_codec_state_dict(codec_cfg, seed=seed), codec_cfg, device, codec_dtype)
    return LoadedModel(config, model, tokenizer, out), codec
