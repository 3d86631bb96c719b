"""ModifiedDAC codec (S1 and S2 share it): config, whole-utterance decode/encode, loading.

docs/formats.md, docs/architecture.md and tests/golden/README.md are the source. The decode path is
fully causal, so `decode_stream` (see `codec_stream.py`) reproduces `decode` chunk by chunk.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from rtts.model.codec_conv import CausalConv1d, CausalConvTranspose1d, ResidualUnit, Snake1d
from rtts.model.codec_layers import (
    CodecTransformerConfig,
    ConvNeXtBlock,
    Decoder,
    DownsampleQuantizer,
    Encoder,
    LayerScale,
    RMSNorm,
    VectorQuantizer,
)
from rtts.model.codec_stream import CodecStreamState, decode_stream, new_stream_state
from rtts.model.errors import CheckpointError

__all__ = [
    "Codec",
    "CodecConfig",
    "CodecStreamState",
    "CodecTransformerConfig",
    "codec_state_dict_keys",
    "load_codec",
    "random_codec_state_dict",
]

# NOTE: the reference builds the encoder transformer with a 512-step window whatever its config says.
ENCODER_WINDOW = 512

# Persistent buffers of the S1-era code (RoPE tables, causal masks): not weights; recomputed here.
STALE_BUFFERS = frozenset(
    {
        "encoder.block.4.block.5.freqs_cis",
        "encoder.block.4.block.5.causal_mask",
        "quantizer.pre_module.freqs_cis",
        "quantizer.pre_module.causal_mask",
        "quantizer.post_module.freqs_cis",
        "quantizer.post_module.causal_mask",
    }
)

_PARAM_G, _PARAM_V = ".parametrizations.weight.original0", ".parametrizations.weight.original1"
_LEGACY_G, _LEGACY_V = ".weight_g", ".weight_v"


def _release_transformer(n_layer: int, window: int) -> CodecTransformerConfig:
    return CodecTransformerConfig(
        n_layer=n_layer, dim=1024, n_head=16, head_dim=64, intermediate_size=3072, window_size=window
    )


@dataclass(frozen=True)
class CodecConfig:
    """All sizes of the codec. The defaults are the release codec (S2-Pro and S1-mini ship the same one)."""

    sample_rate: int = 44100
    frame_length: int = 2048  # samples per code frame (NOT the reference's `hop_length` 512)
    encoder_dim: int = 64
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    latent_dim: int = 1024
    decoder_dim: int = 1536
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    semantic_codebook_size: int = 4096
    n_codebooks: int = 9  # residual codebooks (after the semantic one)
    codebook_size: int = 1024
    codebook_dim: int = 8
    downsample_factor: tuple[int, ...] = (2, 2)
    encoder_transformer: CodecTransformerConfig = field(
        default_factory=lambda: _release_transformer(4, ENCODER_WINDOW)
    )
    pre_module: CodecTransformerConfig = field(default_factory=lambda: _release_transformer(8, 128))
    post_module: CodecTransformerConfig = field(default_factory=lambda: _release_transformer(8, 128))

    def __post_init__(self) -> None:
        down = math.prod(self.downsample_factor)
        if math.prod(self.encoder_rates) * down != self.frame_length:
            raise ValueError(f"encoder_rates x downsample_factor must equal frame_length {self.frame_length}")
        if math.prod(self.decoder_rates) * down != self.frame_length:
            raise ValueError(f"decoder_rates x downsample_factor must equal frame_length {self.frame_length}")
        if self.decoder_dim % (2 ** len(self.decoder_rates)):
            raise ValueError("decoder_dim must halve cleanly through the decoder blocks")
        if self.encoder_transformer.window_size != ENCODER_WINDOW:
            raise ValueError(f"the encoder transformer window is always {ENCODER_WINDOW} in the reference")
        enc_out = self.encoder_dim * 2 ** len(self.encoder_rates)
        for name, cfg, dim in (
            ("encoder_transformer", self.encoder_transformer, enc_out),
            ("pre_module", self.pre_module, self.latent_dim),
            ("post_module", self.post_module, self.latent_dim),
        ):
            if cfg.dim != dim:
                raise ValueError(f"{name}.dim must be {dim} (its input/output projections are identity)")
            if cfg.head_dim % 2:
                raise ValueError(f"{name}.head_dim must be even (RoPE rotates pairs)")

    @property
    def num_codebooks(self) -> int:
        """Rows of a code tensor: 1 semantic + the residual codebooks."""
        return 1 + self.n_codebooks

    @property
    def hop_length(self) -> int:
        """Audio samples per encoder step (the reference's `hop_length`; a frame is 4 of them)."""
        return math.prod(self.encoder_rates)

    @classmethod
    def release(cls) -> CodecConfig:
        return cls()

    @classmethod
    def from_json(cls, path: str | Path) -> CodecConfig:
        """Read the `codec_config.json` format of the golden sets (unknown/informational keys such as
        `where`, `block_size`, `decoder_transformer` are ignored)."""
        try:
            raw = json.loads(Path(path).read_text())
            quant = raw["quantizer"]
            if not raw.get("causal", True):
                raise ValueError("only the causal codec is supported")
            if quant.get("input_dim", raw["latent_dim"]) != raw["latent_dim"]:
                raise ValueError("quantizer.input_dim must equal latent_dim")
            enc = _transformer_from_json(raw["encoder_transformer"], window=ENCODER_WINDOW)
            return cls(
                sample_rate=int(raw["sample_rate"]),
                frame_length=int(raw["frame_length"]),
                encoder_dim=int(raw["encoder_dim"]),
                encoder_rates=tuple(int(r) for r in raw["encoder_rates"]),
                latent_dim=int(raw["latent_dim"]),
                decoder_dim=int(raw["decoder_dim"]),
                decoder_rates=tuple(int(r) for r in raw["decoder_rates"]),
                semantic_codebook_size=int(quant["semantic_codebook_size"]),
                n_codebooks=int(quant["n_codebooks"]),
                codebook_size=int(quant["codebook_size"]),
                codebook_dim=int(quant["codebook_dim"]),
                downsample_factor=tuple(int(f) for f in quant["downsample_factor"]),
                encoder_transformer=enc,
                pre_module=_transformer_from_json(quant["pre_module"]),
                post_module=_transformer_from_json(quant["post_module"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(path, f"invalid codec config: {type(e).__name__}: {e}") from e


def _transformer_from_json(raw: dict[str, Any], window: int | None = None) -> CodecTransformerConfig:
    return CodecTransformerConfig(
        n_layer=int(raw["n_layer"]),
        dim=int(raw["dim"]),
        n_head=int(raw["n_head"]),
        head_dim=int(raw["head_dim"]),
        intermediate_size=int(raw["intermediate_size"]),
        window_size=int(raw["window_size"]) if window is None else window,
        rope_base=float(raw.get("rope_base", 10000.0)),
        norm_eps=float(raw.get("norm_eps", 1e-5)),
    )


class Codec(nn.Module):
    """ModifiedDAC: codes [B, 10, T] <-> 44.1 kHz mono audio [B, T * 2048]. Inference only."""

    def __init__(self, config: CodecConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(
            config.encoder_dim, config.encoder_rates, config.latent_dim, config.encoder_transformer
        )
        self.quantizer = DownsampleQuantizer(
            config.latent_dim,
            config.semantic_codebook_size,
            config.n_codebooks,
            config.codebook_size,
            config.codebook_dim,
            config.downsample_factor,
            config.pre_module,
            config.post_module,
        )
        self.decoder = Decoder(config.latent_dim, config.decoder_dim, config.decoder_rates)
        self.stream_tail_shapes = self._assign_stream_tails()

    def _assign_stream_tails(self) -> tuple[tuple[int, int], ...]:
        """Number the convs of the decode path that need left context when streamed; returns the
        per-slot context shape [C_in, context] of each, in `tail_id` order."""
        shapes: list[tuple[int, int]] = []
        for module in [*self.quantizer.upsample.modules(), *self.decoder.modules()]:
            if isinstance(module, (CausalConv1d, CausalConvTranspose1d)) and module.context > 0:
                if isinstance(module, CausalConv1d):
                    assert module.stride == 1, "streamed causal convs must have stride 1"
                module.tail_id = len(shapes)
                shapes.append((module.conv.in_channels, module.context))
        return tuple(shapes)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def clamp_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """Out-of-range ids clamp like the reference (c0 <= semantic-1, c1.. <= codebook-1, negatives to
        0); returns a new tensor, the caller's is left alone. codes: [B, 10, T] -> [B, 10, T]"""
        cfg = self.config
        semantic = codes[:, :1].clamp(0, cfg.semantic_codebook_size - 1)
        return torch.cat([semantic, codes[:, 1:].clamp(0, cfg.codebook_size - 1)], dim=1)

    def codes_to_latent(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, 10, T] (any ints) -> z_q [B, latent, T]
        if codes.ndim != 3 or codes.shape[1] != self.config.num_codebooks:
            raise ValueError(f"codes must be [B, {self.config.num_codebooks}, T], got {tuple(codes.shape)}")
        return self.quantizer.codes_to_latent(self.clamp_codes(codes.long()))

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, 10, T] int64 -> audio [B, T * frame_length] float in (-1, 1)
        z = self.quantizer.post_module(self.codes_to_latent(codes))
        return self.decoder(self.quantizer.upsample(z))[:, 0]

    def pad_audio(self, audio: torch.Tensor) -> torch.Tensor:
        """Right-pad with zeros to a whole number of frames. audio: [B, N] -> [B, 1, ceil(N/F)*F]"""
        if audio.ndim != 2 or audio.shape[-1] == 0:
            raise ValueError(f"audio must be [B, N] with N > 0, got {tuple(audio.shape)}")
        pad = (-audio.shape[-1]) % self.config.frame_length
        return nn.functional.pad(audio.to(self.dtype), (0, pad))[:, None]

    @torch.no_grad()
    def encode(self, audio: torch.Tensor) -> torch.Tensor:
        # audio: [B, N] float mono at sample_rate in [-1, 1] -> codes [B, 10, ceil(N / frame_length)] int64
        z = self.encoder(self.pad_audio(audio))
        z = self.quantizer.pre_module(self.quantizer.downsample(z))
        return self.quantizer.quantize(z)[0]

    def new_stream_state(self, capacity: int) -> CodecStreamState:
        """Zero streaming state for `capacity` slots, on the codec's device and dtype."""
        return new_stream_state(self, capacity)

    @torch.no_grad()
    def decode_stream(
        self, codes: torch.Tensor, state: CodecStreamState, slots: torch.Tensor | None = None
    ) -> torch.Tensor:
        # codes: [B, 10, t] (t >= 1); slots: [B] int64 distinct indices into the state (None = arange(B))
        # -> audio [B, t * frame_length]; successive calls for a slot concatenate to `decode` of all codes
        return decode_stream(self, codes, state, slots)


# ---------------------------------------------------------------------------------------------------
# On-disk layout
# ---------------------------------------------------------------------------------------------------


def _weight_norm_spellings(codec: Codec) -> dict[str, str]:
    """Fused weight key -> how the release file spells it: 'param' (parametrizations.weight.original0/1,
    the 60 causal convs) or 'legacy' (weight_g/weight_v, the 20 VQ projections)."""
    spelling: dict[str, str] = {}
    for name, module in codec.named_modules():
        if isinstance(module, (CausalConv1d, CausalConvTranspose1d)) and module.weight_norm:
            spelling[f"{name}.conv.weight"] = "param"
        elif isinstance(module, VectorQuantizer):
            spelling[f"{name}.in_proj.weight"] = "legacy"
            spelling[f"{name}.out_proj.weight"] = "legacy"
    return spelling


def _on_disk_names(key: str, spelling: str | None) -> tuple[str, ...]:
    """On-disk names of one fused tensor: (g, v) for weight-normed weights, else the key itself."""
    if spelling is None:
        return (key,)
    stem = key[: -len(".weight")]
    if spelling == "param":
        return stem + _PARAM_G, stem + _PARAM_V
    return stem + _LEGACY_G, stem + _LEGACY_V


def _meta_codec(config: CodecConfig) -> Codec:
    with torch.device("meta"):
        return Codec(config)


def codec_state_dict_keys(config: CodecConfig) -> dict[str, tuple[int, ...]]:
    """On-disk key -> shape of a release-style `codec.pth` for `config` (weights only: the 6 stale
    buffers some files carry are not included). Weight-normed convs appear as g [dim0, 1, ...] + v."""
    codec = _meta_codec(config)
    spellings = _weight_norm_spellings(codec)
    layout: dict[str, tuple[int, ...]] = {}
    for key, tensor in codec.state_dict().items():
        shape = tuple(tensor.shape)
        names = _on_disk_names(key, spellings.get(key))
        if len(names) == 1:
            layout[key] = shape
        else:
            layout[names[0]] = (shape[0],) + (1,) * (len(shape) - 1)
            layout[names[1]] = shape
    return layout


def _random_parameter(module: nn.Module, leaf: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Init scales that keep activations O(1) through the stack (random weights for tests/benchmarks)."""
    noise = torch.randn(shape, generator=gen)
    if isinstance(module, Snake1d):
        return 1.0 + 0.1 * noise
    if isinstance(module, (RMSNorm, nn.LayerNorm)):
        return 1.0 + 0.1 * noise if leaf == "weight" else 0.01 * noise
    if isinstance(module, (LayerScale, ConvNeXtBlock)):  # layer-scale gammas: small, as trained ones are
        return 1e-2 * (1.0 + 0.1 * noise)
    if isinstance(module, nn.Embedding):
        return noise
    if leaf == "bias":
        return 0.01 * noise
    if isinstance(module, nn.ConvTranspose1d):  # [in, out, k]; each output sees in x k/stride taps
        return noise / math.sqrt(shape[0] * shape[2] / module.stride[0])
    if isinstance(module, (nn.Conv1d, nn.Linear)):
        return noise / math.sqrt(math.prod(shape[1:]))
    raise TypeError(f"no random init for {type(module).__name__}.{leaf}")


def _init_gains(codec: Codec) -> dict[str, float]:
    """Extra weight scales (by module name) that keep a random codec well-conditioned.

    NOTE: with variance-preserving convs everywhere, each residual unit doubles the signal's variance;
    after the decoder's 12 units the pre-tanh signal is ~50x too large, tanh saturates and the sin() of
    the Snakes turns float rounding into O(1) output differences (stream vs whole, bf16 vs f32).
    Damping each unit's branch and the last conv keeps activations O(1) and the output unsaturated.
    """
    gains = {f"{name}.block.3.conv": 0.3 for name, m in codec.named_modules() if isinstance(m, ResidualUnit)}
    gains[f"decoder.model.{len(codec.decoder.model) - 2}.conv"] = 0.3
    return gains


def random_codec_state_dict(
    config: CodecConfig, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random weights in the on-disk layout of `codec_state_dict_keys(config)`, deterministic for a seed.
    Weight-normed convs get v = W and g = ||W|| so that fusion returns W."""
    codec = _meta_codec(config)
    spellings = _weight_norm_spellings(codec)
    gains = _init_gains(codec)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key, param in codec.named_parameters():
        owner, leaf = key.rsplit(".", 1)
        weight = _random_parameter(codec.get_submodule(owner), leaf, param.shape, gen)
        if leaf == "weight":
            weight = weight * gains.get(owner, 1.0)
        names = _on_disk_names(key, spellings.get(key))
        if len(names) == 1:
            out[key] = weight.to(dtype)
        else:
            out[names[0]] = _norm_except_dim0(weight).to(dtype)
            out[names[1]] = weight.to(dtype)
    return out


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def _norm_except_dim0(v: torch.Tensor) -> torch.Tensor:
    # v: [d0, ...] -> [d0, 1, ...] L2 norm over all dims but the first (weight norm with dim=0)
    return torch.linalg.vector_norm(v.flatten(1), dim=1).view(-1, *([1] * (v.ndim - 1)))


def _fuse(g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """W = g * v / ||v||, computed in float32 whatever the file's dtype."""
    v32 = v.float()
    return v32 * (g.float() / _norm_except_dim0(v32))


def _read_state_dict(file: Path) -> dict[str, torch.Tensor]:
    try:
        obj = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated/garbage/non-pickle file raises many different types
        raise CheckpointError(file, f"cannot read codec checkpoint: {type(e).__name__}: {e}") from e
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise CheckpointError(file, f"expected a dict of tensors, found {type(obj).__name__}")
    if any(str(k).startswith("generator.") for k in obj):
        # Training checkpoints: keep the generator, drop the discriminator and anything else.
        obj = {k[len("generator.") :]: v for k, v in obj.items() if str(k).startswith("generator.")}
    for key, value in obj.items():
        if not isinstance(value, torch.Tensor):
            raise CheckpointError(file, f"expected a tensor, found {type(value).__name__}", tensor=str(key))
    return obj


def _split_weight_norm(key: str) -> tuple[str, int] | None:
    """'X.parametrizations.weight.original0' / 'X.weight_g' -> ('X.weight', 0); v -> 1; else None."""
    for suffix_g, suffix_v in ((_PARAM_G, _PARAM_V), (_LEGACY_G, _LEGACY_V)):
        for part, suffix in ((0, suffix_g), (1, suffix_v)):
            if key.endswith(suffix):
                return key[: -len(suffix)] + ".weight", part
    return None


def _group_keys(
    raw: dict[str, torch.Tensor], file: Path, expected: dict[str, tuple[int, ...]], spellings: dict[str, str]
) -> tuple[list[str], dict[str, dict[int, str]]]:
    """Sort the file's keys into plain weights and weight-norm pairs (fused key -> {0: g key, 1: v key});
    stale buffers are dropped, anything else is an error."""
    plain: list[str] = []
    pairs: dict[str, dict[int, str]] = {}
    for key in raw:
        if key in STALE_BUFFERS:
            continue
        split = _split_weight_norm(key)
        if split is not None and split[0] in spellings:
            found = pairs.setdefault(split[0], {})
            if split[1] in found:
                raise CheckpointError(
                    file, f"weight-norm tensor stored twice (also as {found[split[1]]})", tensor=key
                )
            found[split[1]] = key
        elif key in spellings:
            raise CheckpointError(
                file, "this conv is weight-normed: expected its g/v tensors, not a plain weight", tensor=key
            )
        elif key in expected:
            plain.append(key)
        else:
            raise CheckpointError(file, "unexpected tensor: not part of a codec with this config", tensor=key)
    return plain, pairs


def _check_complete(
    file: Path,
    expected: dict[str, tuple[int, ...]],
    spellings: dict[str, str],
    plain: list[str],
    pairs: dict[str, dict[int, str]],
) -> None:
    present = set(plain)
    for fused, shape in expected.items():
        if fused not in spellings:
            if fused not in present:
                raise CheckpointError(file, f"missing tensor, expected shape {list(shape)}", tensor=fused)
            continue
        found = pairs.get(fused, {})
        for part, name in enumerate(_on_disk_names(fused, spellings[fused])):
            if part not in found:
                raise CheckpointError(
                    file,
                    "missing tensor (a weight-normed conv needs both g and v; the "
                    "parametrizations.weight.original0/1 and weight_g/weight_v spellings are both accepted)",
                    tensor=name,
                )


def _checked_state_dict(
    raw: dict[str, torch.Tensor], file: Path, codec: Codec
) -> Iterator[tuple[str, torch.Tensor]]:
    """Validate `raw` against the codec's layout strictly, then yield (fused key, tensor) pairs."""
    expected = {k: tuple(t.shape) for k, t in codec.state_dict().items()}
    spellings = _weight_norm_spellings(codec)
    plain, pairs = _group_keys(raw, file, expected, spellings)
    _check_complete(file, expected, spellings, plain, pairs)
    for key in plain:
        yield key, _checked(raw[key], expected[key], file, key)
    for fused, found in pairs.items():
        shape = expected[fused]
        g = _checked(raw[found[0]], (shape[0],) + (1,) * (len(shape) - 1), file, found[0])
        v = _checked(raw[found[1]], shape, file, found[1])
        yield fused, _fuse(g, v)


def _checked(tensor: torch.Tensor, shape: tuple[int, ...], file: Path, key: str) -> torch.Tensor:
    if tuple(tensor.shape) != shape:
        raise CheckpointError(
            file, f"wrong shape {list(tensor.shape)}, expected {list(shape)} for this config", tensor=key
        )
    if not tensor.is_floating_point():
        raise CheckpointError(file, f"expected a floating-point tensor, found {tensor.dtype}", tensor=key)
    return tensor


def _resolve_file(path: str | Path) -> Path:
    file = Path(path)
    if file.is_dir():
        file = file / "codec.pth"
    if not file.is_file():
        raise CheckpointError(file, "codec checkpoint not found")
    return file


def load_codec(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    config: CodecConfig | None = None,
) -> Codec:
    """Load a codec `.pth` (or a checkpoint directory holding `codec.pth`).

    Config: `config`, else `codec_config.json` next to the file, else the release config. Accepts an
    optional `{"state_dict": ...}` wrapper, a `generator.` prefix, both weight-norm spellings; ignores the
    6 stale buffers; anything else missing, misshapen or unexpected raises `CheckpointError`.
    """
    file = _resolve_file(path)
    if config is None:
        config_file = file.parent / "codec_config.json"
        config = CodecConfig.from_json(config_file) if config_file.is_file() else CodecConfig.release()
    return codec_from_state_dict(_read_state_dict(file), config, device, dtype, source=file)


def codec_from_state_dict(
    raw: dict[str, torch.Tensor],
    config: CodecConfig,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    source: str | Path = "<state dict>",
) -> Codec:
    """Build a codec from an on-disk-layout state dict (validated strictly; `raw` is consumed)."""
    file = Path(source)
    codec = _meta_codec(config)  # no storage: the real tensors are assigned below
    weights = {}
    for key, tensor in _checked_state_dict(raw, file, codec):
        weights[key] = tensor.to(device=device, dtype=dtype)
        raw.pop(key, None)  # plain tensors: drop the CPU copy as soon as it is moved/cast
    del raw
    codec.load_state_dict(weights, strict=True, assign=True)
    return codec.eval().requires_grad_(False)


def encode_audio(codec: Codec, audio: np.ndarray) -> torch.Tensor:
    """Mono float32 at the codec rate -> codes [num_codebooks, frames] (CPU int64)."""
    with torch.inference_mode():
        x = torch.from_numpy(audio).to(codec.device, codec.dtype)[None]
        return codec.encode(x)[0].cpu()
