"""Text tokenizers of the two Fish Speech checkpoint formats.

* S2 (`model_type: fish_qwen3_omni`): a HF `tokenizers` file `tokenizer.json` (Qwen byte-level BPE with NFC
  normalization) plus the Fish added tokens. The file's own normalizer / pre-tokenizer / decoder are used
  as they are.
* S1 (`model_type: dual_ar`): `tokenizer.tiktoken` (`base64(bytes) rank` per line) + `special_tokens.json`.
  Special ids are `number of ranks + position in special_tokens.json`: the reference derives them this way
  and never reads the numbers written in that file, so neither do we.

Both give the same interface: `encode` recognises special-token strings anywhere in the text (the prompt
builder relies on that for `<|im_start|>`, `<|voice|>`, ...), and the semantic ids `<|semantic:0..N-1|>` are
a contiguous range read from the file, never hard-coded.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import tiktoken
from tokenizers import Tokenizer

from rtts.model.errors import CheckpointError

# The S1 split regex, alternatives in the order the reference tries them. The 7th alternative really is
# `\s+(\?!\S)` with an escaped `?`: it matches the literal characters "?!" and is NOT the usual `(?!\S)`
# lookahead, so a run of spaces before a word becomes its own piece. Reproducing the quirk is what makes
# the ids match the reference.
S1_SPLIT_PATTERN = "|".join(
    [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"\p{P}",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(\?!\S)",
        r"\s+",
    ]
)

# No leading zeros, so that `<|semantic:05|>` cannot pose as index 5.
_SEMANTIC_RE = re.compile(r"<\|semantic:(0|[1-9][0-9]*)\|>")


@dataclass(frozen=True, eq=False)
class FishTokenizer:
    """A loaded tokenizer plus the special ids the engine needs.

    `eq=False`: tokenizers compare by identity; comparing thousands of special tokens field by field is
    never what a caller wants.
    """

    kind: Literal["hf", "tiktoken"]
    path: str
    special: Mapping[str, int] = field(repr=False)  # thousands of entries in a release tokenizer
    semantic_begin_id: int
    semantic_end_id: int
    im_end_id: int
    im_start_id: int | None
    voice_id: int | None
    interleave_id: int | None
    pad_id: int | None
    num_tokens: int
    backend: Tokenizer | tiktoken.Encoding = field(repr=False)

    @property
    def num_semantic(self) -> int:
        return self.semantic_end_id - self.semantic_begin_id + 1

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no BOS/EOS added; special-token strings inside `text` become their ids."""
        if isinstance(self.backend, Tokenizer):
            return self.backend.encode(text, add_special_tokens=False).ids
        return self.backend.encode(text, allowed_special="all", disallowed_special=())

    def decode(self, ids: Sequence[int]) -> str:
        """Best-effort text of `ids`: special tokens spelled out, bad UTF-8 replaced, unknown ids skipped."""
        if isinstance(self.backend, Tokenizer):
            return self.backend.decode(list(ids), skip_special_tokens=False)
        # tiktoken raises on ids it does not know (e.g. the model's vocab padding rows); its ids are exactly
        # 0..num_tokens-1, so dropping the rest matches what the HF decoder does with unknown ids.
        return self.backend.decode([i for i in ids if 0 <= i < self.num_tokens], errors="replace")


def load_tokenizer(checkpoint_dir: str | Path, model_type: str) -> FishTokenizer:
    """Load the tokenizer of a checkpoint directory; `model_type` is the config's `model_type`."""
    root = Path(checkpoint_dir)
    hf_path = root / "tokenizer.json"
    if model_type == "fish_qwen3_omni":
        return _load_hf(hf_path)
    if model_type == "dual_ar":
        # A converted S1 checkpoint may ship a HF tokenizer instead of the tiktoken pair.
        if hf_path.is_file():
            return _load_hf(hf_path)
        return _load_tiktoken(root / "tokenizer.tiktoken", root / "special_tokens.json")
    raise CheckpointError(
        root, f"unknown model_type {model_type!r} (expected 'fish_qwen3_omni' or 'dual_ar')"
    )


def _load_hf(path: Path) -> FishTokenizer:
    if not path.is_file():
        raise CheckpointError(path, "tokenizer file is missing")
    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare `Exception` for every parse/validation failure
        raise CheckpointError(path, f"not a readable HF tokenizer file ({exc})") from exc
    # Special tokens must be added tokens: only those are matched as single ids inside the text.
    special = {tok.content: tok_id for tok_id, tok in sorted(backend.get_added_tokens_decoder().items())}
    vocab = backend.get_vocab(with_added_tokens=True)
    if not vocab:
        raise CheckpointError(path, "tokenizer has an empty vocabulary")
    return _make("hf", path, special, max(vocab.values()) + 1, backend)


def _load_tiktoken(ranks_path: Path, special_path: Path) -> FishTokenizer:
    ranks = _read_tiktoken_ranks(ranks_path)
    names = _read_special_names(special_path)
    # File order decides the ids; the numbers written in special_tokens.json are ignored, as in the reference.
    special = {name: len(ranks) + i for i, name in enumerate(names)}
    num_tokens = len(ranks) + len(names)
    try:
        backend = tiktoken.Encoding(
            name="fish_s1", pat_str=S1_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=special
        )
    except ValueError as exc:
        raise CheckpointError(ranks_path, f"tiktoken rejected the tokenizer ({exc})") from exc
    return _make("tiktoken", ranks_path, special, num_tokens, backend, special_path=special_path)


def _read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    if not path.is_file():
        raise CheckpointError(path, "tokenizer file is missing")
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise CheckpointError(path, f"cannot read file ({exc})") from exc
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        fields = line.split()
        try:
            if len(fields) != 2:
                raise ValueError("expected 'base64 rank'")
            token = base64.b64decode(fields[0], validate=True)
            rank = int(fields[1])
        except (ValueError, binascii.Error) as exc:
            raise CheckpointError(path, f"line {line_no} is not 'base64(bytes) rank' ({exc})") from exc
        if token in ranks:
            raise CheckpointError(path, f"line {line_no}: token {token!r} is listed twice")
        ranks[token] = rank
    if not ranks:
        raise CheckpointError(path, "no BPE ranks in file")
    # Special ids start at len(ranks): ranks must be exactly 0..n-1, or ids would collide or leave holes.
    if set(ranks.values()) != set(range(len(ranks))):
        raise CheckpointError(path, f"ranks are not exactly 0..{len(ranks) - 1}")
    # Byte-level BPE starts from single bytes; tiktoken panics on text with a byte that has no rank.
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise CheckpointError(
            path, f"{len(missing)} single-byte tokens are missing (first: byte {missing[0]})"
        )
    return ranks


def _read_special_names(path: Path) -> list[str]:
    if not path.is_file():
        raise CheckpointError(path, "special tokens file is missing")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(path, f"not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise CheckpointError(path, "expected a JSON object mapping token strings to ids")
    return list(data)


def _make(
    kind: Literal["hf", "tiktoken"],
    path: Path,
    special: dict[str, int],
    num_tokens: int,
    backend: Tokenizer | tiktoken.Encoding,
    special_path: Path | None = None,
) -> FishTokenizer:
    # Errors about special tokens name the file that declares them (special_tokens.json for S1).
    where = special_path or path
    begin, end = _semantic_range(special, where)
    im_end = special.get("<|im_end|>")
    if im_end is None:
        raise CheckpointError(where, "no <|im_end|> token (the stop token)")
    return FishTokenizer(
        kind=kind,
        path=str(path),
        special=MappingProxyType(special),
        semantic_begin_id=begin,
        semantic_end_id=end,
        im_end_id=im_end,
        im_start_id=special.get("<|im_start|>"),
        voice_id=special.get("<|voice|>"),
        interleave_id=special.get("<|interleave|>"),
        pad_id=special.get("<|pad|>"),
        num_tokens=num_tokens,
        backend=backend,
    )


def _semantic_range(special: Mapping[str, int], where: Path) -> tuple[int, int]:
    """(first, last) id of `<|semantic:0..N-1|>`; the model maps code c to `first + c`, so check that."""
    by_index: dict[int, int] = {}
    for name, tok_id in special.items():
        match = _SEMANTIC_RE.fullmatch(name)
        if match:
            by_index[int(match.group(1))] = tok_id
    if not by_index:
        raise CheckpointError(where, "no <|semantic:N|> tokens")
    count = len(by_index)
    if set(by_index) != set(range(count)):
        missing = min(set(range(count)) - set(by_index))
        raise CheckpointError(
            where, f"semantic tokens are not numbered 0..{count - 1} (<|semantic:{missing}|> is missing)"
        )
    begin = by_index[0]
    for index in range(count):
        if by_index[index] != begin + index:
            raise CheckpointError(
                where,
                f"semantic token ids are not contiguous: <|semantic:{index}|> has id {by_index[index]}, "
                f"expected {begin + index}",
            )
    return begin, begin + count - 1
