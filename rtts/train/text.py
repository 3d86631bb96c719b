"""The demo voice's text front end, entirely inside `tokenizer.json`: lowercased UTF-8 bytes, one token each.

Why bytes and not phones or BPE: the server tokenizes text with tokenizer.json alone, and a pronunciation lexicon
(CMUdict) cannot be expressed there. Among what can, one token per character gives the attention the most regular
text-to-audio alignment (each character covers about two 25 Hz frames) and the smallest embedding table; a BPE's
variable-length pieces would each need a learned duration from less data per piece. Lowercasing (a normalizer in the
file, after NFKD + accent stripping) halves the letters to learn; the added special tokens are matched before
normalization, so the chat framing is untouched. The layout of ids is the release's (`random_tokenizer`): 256 bytes,
`<|endoftext|> <|im_start|> <|im_end|>`, the Qwen extras, the Fish tokens, then `<|semantic:0..N-1|>`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rtts.tools.random_tokenizer import write_s2_tokenizer

NORMALIZER: dict[str, Any] = {
    "type": "Sequence",
    "normalizers": [{"type": "NFKD"}, {"type": "StripAccents"}, {"type": "Lowercase"}, {"type": "NFC"}],
}


def write_tokenizer(out_dir: Path, num_semantic: int) -> dict[str, int]:
    """tokenizer.json (+ tokenizer_config.json, special_tokens_map.json) -> ids by short name (see write_s2_tokenizer)
    plus "vocab_size": num_tokens rounded up to a multiple of 64."""
    ids = write_s2_tokenizer(out_dir, num_base_tokens=256, vocab_size=1 << 30, num_semantic=num_semantic)
    path = out_dir / "tokenizer.json"
    spec = json.loads(path.read_text())
    if len(spec["model"]["merges"]) != 0 or len(spec["model"]["vocab"]) != 256:
        raise AssertionError("expected a byte tokenizer: 256 base tokens and no merges")
    spec["normalizer"] = NORMALIZER
    path.write_text(json.dumps(spec, ensure_ascii=False, indent=2) + "\n")
    ids["vocab_size"] = -(-ids["num_tokens"] // 64) * 64
    return ids


def config_json(ids: dict[str, int], sizes: Any, codebook_size: int, num_codebooks: int) -> dict[str, Any]:
    """The S2 (`fish_qwen3_omni`) config.json for a DualARSizes and the tokenizer's ids."""
    head = sizes.dim // sizes.n_head
    fast_head = sizes.fast_dim // sizes.fast_n_head
    return {
        "model_type": "fish_qwen3_omni",
        "dtype": "bfloat16",
        "eos_token_id": ids["im_end"],
        "pad_token_id": ids["pad"],
        "audio_pad_token_id": ids["audio_pad"],
        "semantic_start_token_id": ids["semantic_begin"],
        "semantic_end_token_id": ids["semantic_end"],
        "text_config": {
            "model_type": "fish_qwen3", "vocab_size": ids["vocab_size"], "n_layer": sizes.n_layer,
            "n_head": sizes.n_head, "n_local_heads": sizes.n_local_heads, "head_dim": head, "dim": sizes.dim,
            "intermediate_size": sizes.ffn, "rope_base": 10000.0, "norm_eps": 1e-06,
            "max_seq_len": sizes.max_seq_len, "tie_word_embeddings": True, "attention_qkv_bias": False,
            "attention_o_bias": False, "attention_qk_norm": True,
        },
        "audio_decoder_config": {
            "model_type": "fish_qwen3_audio_decoder", "vocab_size": codebook_size, "n_layer": sizes.n_fast_layer,
            "n_head": sizes.fast_n_head, "n_local_heads": sizes.fast_n_head, "head_dim": fast_head,
            "dim": sizes.fast_dim, "intermediate_size": sizes.fast_ffn, "attention_qkv_bias": False,
            "attention_o_bias": False, "attention_qk_norm": False, "num_codebooks": num_codebooks,
        },
    }
