"""`DualARConfig`: the resolved hyper-parameters of a DualAR checkpoint, from either release format.

Two `config.json` shapes exist:
- S2-Pro, `model_type: fish_qwen3_omni`: nested `text_config` (slow model) and `audio_decoder_config` (fast model);
  `scale_codebook_embeddings` and `norm_fastlayer_input` are always true for this format.
- S1-mini, `model_type: dual_ar`: one flat dict; `fast_*` fields fall back to the slow value; the fast model is fed the
  pre-norm hidden (`norm_fastlayer_input` does not exist in that format).

The semantic token range is not part of this config: it comes from the tokenizer (see `tokenizer.py`), exactly as the
reference does, and is checked against the config where the config states it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from rtts.model.errors import CheckpointError

ModelFormat = Literal["s2", "s1"]


@dataclass(frozen=True)
class DualARConfig:
    model_type: str  # "fish_qwen3_omni" (S2) or "dual_ar" (S1)
    vocab_size: int
    n_layer: int
    n_head: int
    n_local_heads: int
    head_dim: int
    dim: int
    intermediate_size: int
    rope_base: float
    norm_eps: float
    max_seq_len: int
    tie_word_embeddings: bool
    attention_qkv_bias: bool
    attention_o_bias: bool
    attention_qk_norm: bool
    codebook_size: int
    num_codebooks: int
    scale_codebook_embeddings: bool
    norm_fastlayer_input: bool
    n_fast_layer: int
    fast_dim: int
    fast_n_head: int
    fast_n_local_heads: int
    fast_head_dim: int
    fast_intermediate_size: int
    fast_attention_qkv_bias: bool
    fast_attention_o_bias: bool
    fast_attention_qk_norm: bool
    # Stated by S2 configs only; verified against the tokenizer at load time.
    semantic_start_token_id: int | None = None
    semantic_end_token_id: int | None = None
    eos_token_id: int | None = None
    quantization: str | None = None  # "fp8_block": transformer linears stored as block-scaled FP8 (rtts quantize)

    @property
    def format(self) -> ModelFormat:
        return "s2" if self.model_type == "fish_qwen3_omni" else "s1"

    @property
    def q_size(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_local_heads * self.head_dim

    @property
    def fast_q_size(self) -> int:
        return self.fast_n_head * self.fast_head_dim

    @property
    def fast_kv_size(self) -> int:
        return self.fast_n_local_heads * self.fast_head_dim

    @property
    def rows(self) -> int:
        """Rows of a prompt column: the text/semantic token plus one per codebook."""
        return self.num_codebooks + 1

    def with_(self, **changes: Any) -> DualARConfig:
        return replace(self, **changes)

    # ------------------------------------------------------------------ parsing

    @classmethod
    def from_file(cls, path: str | Path) -> DualARConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(path, "config.json not found") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(path, f"unreadable config: {e}") from None
        if not isinstance(raw, dict):
            raise CheckpointError(path, "config must be a JSON object")
        return cls.from_dict(raw, source=path)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str | Path = "config.json") -> DualARConfig:
        model_type = raw.get("model_type")
        try:
            if model_type == "fish_qwen3_omni":
                cfg = _from_fish_qwen3_omni(raw)
            elif model_type == "dual_ar":
                cfg = _from_dual_ar(raw)
            else:
                raise CheckpointError(
                    source, f"unknown model_type {model_type!r} (expected 'fish_qwen3_omni' or 'dual_ar')"
                )
            q = raw.get("quantization")
            if q is not None:
                method = q.get("method") if isinstance(q, dict) else None
                if method != "fp8_block" or list(q.get("block", [])) != [128, 128]:
                    raise ValueError(f"unsupported quantization {q!r} (rtts reads fp8_block with 128x128 blocks)")
                cfg = replace(cfg, quantization=method)
        except (TypeError, ValueError, KeyError) as e:
            raise CheckpointError(source, f"invalid config field: {e}") from None
        cfg.validate(source)
        return cfg

    def validate(self, source: str | Path = "config.json") -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise CheckpointError(source, msg)

        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and f.name not in (
                "semantic_start_token_id", "semantic_end_token_id", "eos_token_id"
            ):
                need(v > 0, f"{f.name} must be positive, got {v}")
        need(self.n_head % self.n_local_heads == 0, "n_head must be a multiple of n_local_heads")
        need(self.fast_n_head % self.fast_n_local_heads == 0, "fast_n_head must be a multiple of fast_n_local_heads")
        need(self.head_dim % 2 == 0 and self.fast_head_dim % 2 == 0, "head_dim must be even (RoPE pairs)")
        need(self.norm_eps > 0 and math.isfinite(self.rope_base), "bad norm_eps / rope_base")


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _default_ffn(dim: int) -> int:
    # BaseModelArgs default: round_up(int(2 * 4 * dim / 3), 256)
    return _round_up(int(2 * 4 * dim / 3), 256)


def _from_fish_qwen3_omni(raw: dict[str, Any]) -> DualARConfig:
    t = raw["text_config"]
    a = raw["audio_decoder_config"]
    dim = int(t.get("dim", 4096))
    n_head = int(t.get("n_head", 32))
    n_local = int(t.get("n_local_heads", -1))
    n_local = n_head if n_local == -1 else n_local
    head_dim = int(t.get("head_dim", 64))
    ffn = int(t.get("intermediate_size") or _default_ffn(dim))
    fast_n_head = int(a.get("n_head", n_head))
    fast_local = int(a.get("n_local_heads", -1))
    fast_local = fast_n_head if fast_local == -1 else fast_local
    return DualARConfig(
        model_type="fish_qwen3_omni",
        vocab_size=int(t.get("vocab_size", 32000)),
        n_layer=int(t.get("n_layer", 32)),
        n_head=n_head,
        n_local_heads=n_local,
        head_dim=head_dim,
        dim=dim,
        intermediate_size=ffn,
        rope_base=float(t.get("rope_base", 10000.0)),
        norm_eps=float(t.get("norm_eps", 1e-5)),
        max_seq_len=int(t.get("max_seq_len", 2048)),
        tie_word_embeddings=bool(t.get("tie_word_embeddings", True)),
        attention_qkv_bias=bool(t.get("attention_qkv_bias", False)),
        attention_o_bias=bool(t.get("attention_o_bias", False)),
        attention_qk_norm=bool(t.get("attention_qk_norm", False)),
        codebook_size=int(a["vocab_size"]),
        num_codebooks=int(a["num_codebooks"]),
        # Hard-coded for this format by the reference loader.
        scale_codebook_embeddings=True,
        norm_fastlayer_input=True,
        n_fast_layer=int(a.get("n_layer", 4)),
        fast_dim=int(a.get("dim", dim)),
        fast_n_head=fast_n_head,
        fast_n_local_heads=fast_local,
        fast_head_dim=int(a.get("head_dim", head_dim)),
        fast_intermediate_size=int(a.get("intermediate_size", ffn)),
        fast_attention_qkv_bias=bool(a.get("attention_qkv_bias", False)),
        fast_attention_o_bias=bool(a.get("attention_o_bias", False)),
        fast_attention_qk_norm=bool(a.get("attention_qk_norm", False)),
        semantic_start_token_id=_opt_int(raw.get("semantic_start_token_id")),
        semantic_end_token_id=_opt_int(raw.get("semantic_end_token_id")),
        eos_token_id=_opt_int(raw.get("eos_token_id")),
    )


# Keys the S1-era config class knows; anything else made the reference refuse the file. We are lenient about
# training-only extras but refuse `norm_fastlayer_input`, which would silently change the math if honoured.
_S1_KEYS = {
    "model_type", "vocab_size", "n_layer", "n_head", "n_local_heads", "head_dim", "dim", "intermediate_size",
    "rope_base", "norm_eps", "max_seq_len", "dropout", "tie_word_embeddings", "attention_qkv_bias",
    "attention_o_bias", "attention_qk_norm", "codebook_size", "num_codebooks", "use_gradient_checkpointing",
    "initializer_range", "is_reward_model", "scale_codebook_embeddings", "n_fast_layer", "fast_dim", "fast_n_head",
    "fast_n_local_heads", "fast_head_dim", "fast_intermediate_size", "fast_attention_qkv_bias",
    "fast_attention_o_bias", "fast_attention_qk_norm", "share_codebook_embeddings", "use_moe", "quantization",
}


def _from_dual_ar(raw: dict[str, Any]) -> DualARConfig:
    unknown = sorted(set(raw) - _S1_KEYS)
    if unknown:
        raise ValueError(f"unknown dual_ar config keys {unknown}")
    if raw.get("is_reward_model"):
        raise ValueError("is_reward_model checkpoints are not TTS models")
    dim = int(raw.get("dim", 4096))
    n_head = int(raw.get("n_head", 32))
    n_local = int(raw.get("n_local_heads", -1))
    n_local = n_head if n_local == -1 else n_local
    head_dim = int(raw.get("head_dim", 64))
    ffn = int(raw.get("intermediate_size") or _default_ffn(dim))

    def fast(key: str, slow: Any) -> Any:
        v = raw.get(f"fast_{key}")
        return slow if v is None else v

    fast_n_head = int(fast("n_head", n_head))
    fast_local = int(fast("n_local_heads", n_local))
    return DualARConfig(
        model_type="dual_ar",
        vocab_size=int(raw.get("vocab_size", 32000)),
        n_layer=int(raw.get("n_layer", 32)),
        n_head=n_head,
        n_local_heads=n_local,
        head_dim=head_dim,
        dim=dim,
        intermediate_size=ffn,
        rope_base=float(raw.get("rope_base", 10000.0)),
        norm_eps=float(raw.get("norm_eps", 1e-5)),
        max_seq_len=int(raw.get("max_seq_len", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        attention_qkv_bias=bool(raw.get("attention_qkv_bias", False)),
        attention_o_bias=bool(raw.get("attention_o_bias", False)),
        attention_qk_norm=bool(raw.get("attention_qk_norm", False)),
        codebook_size=int(raw.get("codebook_size", 160)),
        num_codebooks=int(raw.get("num_codebooks", 4)),
        scale_codebook_embeddings=bool(raw.get("scale_codebook_embeddings", False)),
        norm_fastlayer_input=False,
        n_fast_layer=int(raw.get("n_fast_layer", 4)),
        fast_dim=int(fast("dim", dim)),
        fast_n_head=fast_n_head,
        fast_n_local_heads=fast_local,
        fast_head_dim=int(fast("head_dim", head_dim)),
        fast_intermediate_size=int(fast("intermediate_size", ffn)),
        fast_attention_qkv_bias=bool(fast("attention_qkv_bias", raw.get("attention_qkv_bias", False))),
        fast_attention_o_bias=bool(fast("attention_o_bias", raw.get("attention_o_bias", False))),
        fast_attention_qk_norm=bool(fast("attention_qk_norm", raw.get("attention_qk_norm", False))),
    )


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


# Released values, used by `rtts make-random-checkpoint`. They are written out as config.json in the release's own
# shape and read back through the parsers above, so the presets exercise the real loading path.
S2_PRO_CONFIG_JSON: dict[str, Any] = {
    "model_type": "fish_qwen3_omni",
    "dtype": "bfloat16",
    "eos_token_id": 151645,
    "pad_token_id": 151669,
    "audio_pad_token_id": 151677,
    "semantic_start_token_id": 151678,
    "semantic_end_token_id": 155773,
    "text_config": {
        "model_type": "fish_qwen3", "vocab_size": 155776, "n_layer": 36, "n_head": 32, "n_local_heads": 8,
        "head_dim": 128, "dim": 2560, "intermediate_size": 9728, "rope_base": 1000000.0, "norm_eps": 1e-06,
        "max_seq_len": 32768, "dropout": 0.0, "tie_word_embeddings": True, "attention_qkv_bias": False,
        "attention_o_bias": False, "attention_qk_norm": True, "use_moe": False, "audio_embed_dim": 2560,
        "audio_hidden_dim": 5120, "initializer_range": 0.019764235376052372,
    },
    "audio_decoder_config": {
        "model_type": "fish_qwen3_audio_decoder", "vocab_size": 4096, "n_layer": 4, "n_head": 32,
        "n_local_heads": 8, "head_dim": 128, "dim": 2560, "intermediate_size": 9728, "rope_base": 1000000.0,
        "norm_eps": 1e-06, "max_seq_len": 11, "dropout": 0.0, "tie_word_embeddings": False,
        "attention_qkv_bias": False, "attention_o_bias": False, "attention_qk_norm": False,
        "initializer_range": 0.019764235376052372, "text_dim": 2560, "num_codebooks": 10,
    },
}

S1_MINI_CONFIG_JSON: dict[str, Any] = {
    "model_type": "dual_ar", "vocab_size": 155776, "n_layer": 28, "n_head": 16, "n_local_heads": 8, "head_dim": 128,
    "dim": 1024, "intermediate_size": 3072, "rope_base": 1000000.0, "norm_eps": 1e-06, "max_seq_len": 8192,
    "dropout": 0.0, "tie_word_embeddings": False, "attention_qkv_bias": False, "attention_o_bias": False,
    "attention_qk_norm": True, "codebook_size": 4096, "num_codebooks": 10, "use_gradient_checkpointing": True,
    "initializer_range": 0.02, "is_reward_model": False, "scale_codebook_embeddings": True, "n_fast_layer": 4,
    "fast_dim": 1024, "fast_n_head": 16, "fast_n_local_heads": 8, "fast_head_dim": 64, "fast_intermediate_size": 3072,
    "fast_attention_qkv_bias": False, "fast_attention_o_bias": False, "fast_attention_qk_norm": False,
}
