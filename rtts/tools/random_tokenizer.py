"""Tokenizer files in the release layout, for random-weight checkpoints.

A random checkpoint needs a tokenizer that loads through the normal path (`load_tokenizer`) and gives the
release's special ids, so that prompt lengths, stop tokens and the semantic id range behave as with the real
model. The BPE itself only has to be plausible: the `tokenizers` library's BPE trainer learns merges from a small
built-in English text (so that ordinary text encodes to fewer tokens than bytes), then unreachable filler tokens
fill the vocabulary up to the release's base size. Output is deterministic (same bytes every run).
"""

from __future__ import annotations

import base64
import itertools
import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, trainers

from rtts.model.tokenizer import S1_SPLIT_PATTERN

# Written for this module; plain ASCII English with the common words of typical TTS input.
_TRAINING_TEXT = """\
The morning train was late again, so we stood on the platform and talked about the weather.
It had rained all night, and the streets were still shining when the sun came out over the river.
She said that the best way to learn a new language is to listen to people speaking it every day.
I think you should read the letter out loud before you send it; the words sound different that way.
There are three things to remember: speak slowly, breathe between sentences, and smile when you can.
How are you doing today? I hope the meeting went well and that nobody asked too many questions.
We will meet at the station at half past seven, then walk to the little restaurant near the bridge.
The children were playing in the garden while their parents prepared dinner in the kitchen.
Please turn off the lights when you leave the room, and do not forget to lock the front door.
This is a short test of the speech model, and the voice should sound natural and clear.
He opened the window, looked at the mountains in the distance, and decided to go for a long walk.
Thank you for calling. Your order has been shipped and should arrive within two or three days.
The quick brown fox jumps over the lazy dog, and the dog does not seem to mind at all.
They were talking about music, books, and the places they wanted to visit next summer.
If you have any questions about the new schedule, write to us or call the office in the afternoon.
Good evening, everyone. Tonight we have a special program with news from around the world.
The old house at the end of the street has been empty for years, but someone lives there now.
When the story was finished, the room was quiet for a moment, and then everyone started laughing.
It's not what you say, it's how you say it; the same sentence can mean something else entirely.
Remember to drink water, get enough sleep, and take a break from the screen every hour or so.
"""

# Qwen-style added tokens between `<|im_end|>` and the Fish tokens (release ids 151646..151668);
# the flag says whether the token is marked special.
_QWEN_EXTRA_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", True),
    ("<|fim_middle|>", True),
    ("<|fim_suffix|>", True),
    ("<|fim_pad|>", True),
    ("<|repo_name|>", True),
    ("<|file_sep|>", True),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)

_S2_FISH_TOKENS = (
    "<|pad|>",
    "<|phoneme_start|>",
    "<|phoneme_end|>",
    "<|text|>",
    "<|voice|>",
    "<|interleave|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
)

_S1_NAMED_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|phoneme_start|>",
    "<|phoneme_end|>",
    "<|tool_call_start|>",
    "<|tool_call_end|>",
    "<|text|>",
    "<|voice|>",
    "<|interleave|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio|>",
)

# The S2 (Qwen) pre-tokenizer split regex, as in the release tokenizer.json.
_S2_SPLIT_REGEX = "|".join(
    [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",
        r"[^\r\n\p{L}\p{N}]?\p{L}+",
        r"\p{N}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",  # a real lookahead here, unlike S1's `\s+(\?!\S)`
        r"\s+",
    ]
)
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}

# Bytes that the byte-level mapping keeps as their own Latin-1 character ('!'..'~', '¡'..'¬', '®'..'ÿ').
_PRINTABLE_BYTES: tuple[int, ...] = (*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100))

# Filler tokens start with two NUL bytes, which the training text never contains: they cannot collide with a
# learned token, and no merge ever produces them.
_FILLER_PREFIX = b"\x00\x00"


def write_s2_tokenizer(
    out_dir: str | Path, *, num_base_tokens: int, vocab_size: int, num_semantic: int
) -> dict[str, int]:
    """Write `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json` (S2 layout) into `out_dir`.

    Ids: base BPE 0..num_base_tokens-1, then `<|endoftext|> <|im_start|> <|im_end|>`, the 23 Qwen extras,
    the 9 Fish tokens and `<|semantic:0..num_semantic-1|>`. Returns the ids by short name (`"im_end"`,
    `"voice"`, ..., `"semantic_begin"`, `"semantic_end"`, `"num_tokens"`).
    """
    _check_sizes(num_base_tokens, num_semantic)
    added: list[tuple[str, bool]] = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True)]
    added += _QWEN_EXTRA_TOKENS
    added += [(name, True) for name in _S2_FISH_TOKENS]
    added += [(f"<|semantic:{i}|>", True) for i in range(num_semantic)]
    num_tokens = num_base_tokens + len(added)
    if num_tokens > vocab_size:
        raise ValueError(f"{num_tokens} tokens do not fit in vocab_size {vocab_size}")

    tokenizer = _trained_bpe(_S2_SPLIT_REGEX, normalize=True, vocab_size=num_base_tokens)
    learned = json.loads(tokenizer.to_str())["model"]
    vocab: dict[str, int] = learned["vocab"]
    to_char = _byte_to_unicode()
    for i in range(num_base_tokens - len(vocab)):
        vocab["".join(to_char[b] for b in _FILLER_PREFIX + str(i).encode())] = len(vocab)
    merges = [(left, right) for left, right in learned["merges"]]
    # The release spells both affixes as "" (the trainer leaves them null); the filler tokens join no merge.
    tokenizer.model = models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="")
    # In order, so each gets the next id (num_base_tokens + position); in runs of one flag, as each call rebuilds the
    # added-token matcher.
    for is_special, run in itertools.groupby(added, key=lambda item: item[1]):
        tokens = [AddedToken(name, normalized=False, special=is_special) for name, _ in run]
        (tokenizer.add_special_tokens if is_special else tokenizer.add_tokens)(tokens)
    ids_of = {name: _token_id(tokenizer, name) for name, _ in added}  # the ids tokenizer.json holds

    token_flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(ids_of[name]): {"content": name, **token_flags, "special": is_special} for name, is_special in added
        },
        "additional_special_tokens": list(_S2_FISH_TOKENS),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "pad_token": "<|pad|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    special_map = {
        "additional_special_tokens": list(_S2_FISH_TOKENS),
        "eos_token": {"content": "<|im_end|>", **token_flags},
        "pad_token": {"content": "<|pad|>", **token_flags},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    _write_json(out / "tokenizer_config.json", config)
    _write_json(out / "special_tokens_map.json", special_map)

    named = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", *_S2_FISH_TOKENS)
    ids = {_short_name(name): ids_of[name] for name in named}
    return _with_semantic(ids, num_tokens - num_semantic, num_semantic, num_tokens)


def write_s1_tokenizer(out_dir: str | Path, *, num_ranks: int, num_semantic: int) -> dict[str, int]:
    """Write `tokenizer.tiktoken` + `special_tokens.json` (S1 layout) into `out_dir`.

    Ranks 0..255 are the single bytes (rank = byte value), then the learned tokens, then filler byte strings up to
    `num_ranks`; special ids are `num_ranks + position` (the 15 named tokens, then the semantic tokens).
    Returns the ids by short name (`"im_end"`, ..., `"semantic_begin"`, `"semantic_end"`, `"num_tokens"`).
    """
    _check_sizes(num_ranks, num_semantic)
    tokenizer = _trained_bpe(S1_SPLIT_PATTERN, normalize=False, vocab_size=num_ranks)
    to_byte = {c: b for b, c in _byte_to_unicode().items()}
    tokens: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    # The trainer numbers its tokens in the order it made them, so every token's parts have lower ranks, as tiktoken
    # needs; the 256 single-byte tokens it starts from are already in place.
    for piece, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1]):
        tokens.setdefault(bytes(to_byte[c] for c in piece), len(tokens))
    for i in range(num_ranks - len(tokens)):
        tokens[_FILLER_PREFIX + str(i).encode()] = len(tokens)
    names = [*_S1_NAMED_TOKENS, *(f"<|semantic:{i}|>" for i in range(num_semantic))]
    special = {name: num_ranks + i for i, name in enumerate(names)}

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"{base64.b64encode(token).decode('ascii')} {rank}\n" for token, rank in tokens.items()]
    (out / "tokenizer.tiktoken").write_text("".join(lines), encoding="ascii")
    _write_json(out / "special_tokens.json", special)

    ids = {_short_name(name): special[name] for name in _S1_NAMED_TOKENS}
    return _with_semantic(ids, num_ranks + len(_S1_NAMED_TOKENS), num_semantic, num_ranks + len(names))


def _check_sizes(num_base: int, num_semantic: int) -> None:
    if num_base < 256:
        raise ValueError(f"a byte-level BPE needs at least 256 base tokens, got {num_base}")
    if num_semantic < 1:
        raise ValueError(f"num_semantic must be positive, got {num_semantic}")


def _trained_bpe(split_regex: str, *, normalize: bool, vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on the built-in text: at most `vocab_size` tokens (the 256 bytes first, in code point
    order, which is the release's byte order), merging only pairs seen at least twice.

    The pipeline is given as the release's tokenizer.json spells it: `decoders.ByteLevel()` cannot set its flags
    and would be written with all of them true."""
    spec: dict[str, Any] = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": {"type": "NFC"} if normalize else None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": split_regex}, "behavior": "Isolated", "invert": False},
                _BYTE_LEVEL,
            ],
        },
        "post_processor": _BYTE_LEVEL,
        "decoder": _BYTE_LEVEL,
        "model": {"type": "BPE", "vocab": {}, "merges": []},
    }
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator([_TRAINING_TEXT], trainer)
    return tokenizer


def _token_id(tokenizer: Tokenizer, name: str) -> int:
    token_id = tokenizer.token_to_id(name)
    assert token_id is not None, f"{name} was not added"
    return token_id


def _byte_to_unicode() -> dict[int, str]:
    """The byte-level mapping of the `ByteLevel` pre-tokenizer: printable bytes map to themselves, the others to
    code points 256, 257, ... in byte order, so every token is a printable string."""
    mapping = {b: chr(b) for b in _PRINTABLE_BYTES}
    others = (b for b in range(256) if b not in mapping)
    mapping.update({b: chr(256 + n) for n, b in enumerate(others)})
    return mapping


def _short_name(token: str) -> str:
    return token.removeprefix("<|").removesuffix("|>")


def _with_semantic(ids: dict[str, int], begin: int, num_semantic: int, num_tokens: int) -> dict[str, int]:
    return {
        **ids,
        "semantic_begin": begin,
        "semantic_end": begin + num_semantic - 1,
        "num_tokens": num_tokens,
    }


def _write_json(path: Path, data: object) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
