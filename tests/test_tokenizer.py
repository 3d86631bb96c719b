"""Both tokenizer formats against the golden fixtures, load failures, and the random-tokenizer writers."""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from conftest import GOLDEN  # one place decides where the fixtures are

from rtts.model.errors import CheckpointError
from rtts.model.tokenizer import FishTokenizer, load_tokenizer
from rtts.tools.random_tokenizer import write_s1_tokenizer, write_s2_tokenizer

S2_DIR = GOLDEN / "tiny-s2"
S1_DIR = GOLDEN / "tiny-s1"
S2_TYPE = "fish_qwen3_omni"
S1_TYPE = "dual_ar"
SETS = {"tiny-s2": (S2_DIR, S2_TYPE), "tiny-s1": (S1_DIR, S1_TYPE)}

pytestmark = pytest.mark.usefixtures("golden")  # fails loudly when the fixtures are missing


@pytest.fixture(scope="module")
def s2() -> FishTokenizer:
    return load_tokenizer(S2_DIR, S2_TYPE)


@pytest.fixture(scope="module")
def s1() -> FishTokenizer:
    return load_tokenizer(S1_DIR, S1_TYPE)


def _probes() -> list[Any]:
    """Every recorded (text, ids) probe of both sets: all JSON files in each fixtures/tokenizer folder."""
    params = []
    for name, (root, _) in SETS.items():
        for probe_file in sorted((root / "fixtures" / "tokenizer").glob("*.json")):
            for i, probe in enumerate(json.loads(probe_file.read_text(encoding="utf-8"))):
                params.append(
                    pytest.param(name, probe["text"], probe["ids"], id=f"{name}/{probe_file.stem}/{i}")
                )
    return params


def _case_parts() -> list[Any]:
    params = []
    for name, (root, _) in SETS.items():
        for case in json.loads((root / "fixtures" / "cases.json").read_text(encoding="utf-8")):
            for b, batch in enumerate(case["batches"]):
                for p, part in enumerate(batch["parts"]):
                    if part["type"] == "text":
                        params.append(
                            pytest.param(
                                name, part["text"], part["ids"], id=f"{name}/{case['name']}/b{b}/p{p}"
                            )
                        )
    return params


@functools.cache
def _load(name: str) -> FishTokenizer:
    root, model_type = SETS[name]
    return load_tokenizer(root, model_type)


@pytest.mark.parametrize(("name", "text", "ids"), _probes() if GOLDEN.is_dir() else [])
def test_encode_probes(name: str, text: str, ids: list[int]) -> None:
    assert _load(name).encode(text) == ids


@pytest.mark.parametrize(("name", "text", "ids"), _case_parts() if GOLDEN.is_dir() else [])
def test_case_prompt_parts(name: str, text: str, ids: list[int]) -> None:
    assert _load(name).encode(text) == ids


def test_probe_files_are_not_empty() -> None:
    # Guards against a silently empty parametrization (renamed fixture folder, empty glob).
    names = {p.values[0] for p in _probes()}
    assert names == {"tiny-s2", "tiny-s1"}


def test_s2_special_ids(s2: FishTokenizer) -> None:
    assert s2.kind == "hf"
    assert s2.path == str(S2_DIR / "tokenizer.json")
    assert (s2.im_end_id, s2.im_start_id, s2.pad_id) == (413, 412, 437)
    assert (s2.voice_id, s2.interleave_id) == (441, 442)
    assert (s2.semantic_begin_id, s2.semantic_end_id, s2.num_semantic) == (446, 509, 64)
    assert s2.special["<|endoftext|>"] == 411
    assert s2.special["<|audio_pad|>"] == 445
    assert s2.num_tokens == 510
    # `<|speaker:N|>` is ordinary text, never an added token.
    assert not any(t.startswith("<|speaker") for t in s2.special)


def test_s1_special_ids(s1: FishTokenizer) -> None:
    assert s1.kind == "tiktoken"
    assert s1.path == str(S1_DIR / "tokenizer.tiktoken")
    assert (s1.im_end_id, s1.im_start_id, s1.pad_id) == (437, 436, 435)
    assert (s1.voice_id, s1.interleave_id) == (443, 444)
    assert (s1.semantic_begin_id, s1.semantic_end_id, s1.num_semantic) == (448, 511, 64)
    assert s1.special["<|begin_of_text|>"] == 433
    assert s1.special["<|audio|>"] == 447
    assert s1.num_tokens == 512


def test_decode_round_trip(s2: FishTokenizer, s1: FishTokenizer) -> None:
    text = "Grüße, cafe\u0301 <|speaker:0|>hi<|im_end|>\n  two  spaces?!"
    # S2 normalizes to NFC; S1 does no normalization at all.
    assert s2.decode(s2.encode(text)) == unicodedata.normalize("NFC", text)
    assert s1.decode(s1.encode(text)) == text
    # Ids the tokenizer does not know (the model's vocab padding rows) are skipped, not an error.
    assert s1.decode([72, s1.num_tokens, 105]) == "Hi"
    assert s2.decode([38, s2.num_tokens + 1]) == "G"


def test_hf_tokenizer_in_dual_ar_dir(tmp_path: Path) -> None:
    shutil.copy(S2_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = load_tokenizer(tmp_path, S1_TYPE)
    assert tok.kind == "hf"
    assert tok.im_end_id == 413


def _copy_s1(tmp_path: Path, special: dict[str, Any] | None = None) -> Path:
    shutil.copy(S1_DIR / "tokenizer.tiktoken", tmp_path / "tokenizer.tiktoken")
    if special is None:
        shutil.copy(S1_DIR / "special_tokens.json", tmp_path / "special_tokens.json")
    else:
        (tmp_path / "special_tokens.json").write_text(json.dumps(special), encoding="utf-8")
    return tmp_path


def _golden_s1_special() -> dict[str, int]:
    return json.loads((S1_DIR / "special_tokens.json").read_text(encoding="utf-8"))


def test_s1_ignores_numbers_in_special_tokens_json(tmp_path: Path, s1: FishTokenizer) -> None:
    wrong = {name: 100_000 - 7 * i for i, name in enumerate(_golden_s1_special())}
    tok = load_tokenizer(_copy_s1(tmp_path, wrong), S1_TYPE)
    assert dict(tok.special) == dict(s1.special)
    assert tok.encode("<|interleave|>hi<|im_end|>") == [444, 104, 105, 437]


def test_s1_ids_follow_file_order(tmp_path: Path) -> None:
    golden = _golden_s1_special()
    names = list(golden)
    names[3], names[4] = names[4], names[3]  # <|im_end|> before <|im_start|>, numbers left as they were
    tok = load_tokenizer(_copy_s1(tmp_path, {name: golden[name] for name in names}), S1_TYPE)
    assert (tok.im_end_id, tok.im_start_id) == (436, 437)


def _expect_error(directory: Path, model_type: str, file_name: str) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        load_tokenizer(directory, model_type)
    assert file_name in str(info.value)
    assert Path(info.value.path).name == file_name
    return info.value


def test_missing_files(tmp_path: Path) -> None:
    _expect_error(tmp_path, S2_TYPE, "tokenizer.json")
    _expect_error(tmp_path, S1_TYPE, "tokenizer.tiktoken")
    shutil.copy(S1_DIR / "tokenizer.tiktoken", tmp_path / "tokenizer.tiktoken")
    _expect_error(tmp_path, S1_TYPE, "special_tokens.json")


def test_unknown_model_type(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="model_type"):
        load_tokenizer(tmp_path, "llama")


@pytest.mark.parametrize(
    "content",
    ['{"version": "1.0", "model": ', '{"not": "a tokenizer"}', "\x00\x01garbage"],
    ids=["truncated", "wrong-json", "binary"],
)
def test_garbage_hf_file(tmp_path: Path, content: str) -> None:
    (tmp_path / "tokenizer.json").write_text(content, encoding="utf-8")
    _expect_error(tmp_path, S2_TYPE, "tokenizer.json")


@pytest.mark.parametrize(
    "content",
    ["QUE= 0\nnot base64 at all\n", "QUE= zero\n", "", "QUE= 0\nQUI= 5\n", "QUE= 0\nQUI= 1\n"],
    ids=["bad-base64", "bad-rank", "empty", "rank-gap", "no-byte-tokens"],
)
def test_garbage_tiktoken_file(tmp_path: Path, content: str) -> None:
    _copy_s1(tmp_path)
    (tmp_path / "tokenizer.tiktoken").write_text(content, encoding="ascii")
    _expect_error(tmp_path, S1_TYPE, "tokenizer.tiktoken")


@pytest.mark.parametrize("content", ["{not json", '["<|im_end|>"]'], ids=["bad-json", "not-object"])
def test_garbage_special_tokens_file(tmp_path: Path, content: str) -> None:
    _copy_s1(tmp_path)
    (tmp_path / "special_tokens.json").write_text(content, encoding="utf-8")
    _expect_error(tmp_path, S1_TYPE, "special_tokens.json")


def _write_modified_s2(tmp_path: Path, edit_added: Any) -> Path:
    data = json.loads((S2_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    data["added_tokens"] = edit_added(data["added_tokens"])
    (tmp_path / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    return tmp_path


def test_hf_without_semantic_tokens(tmp_path: Path) -> None:
    _write_modified_s2(tmp_path, lambda added: [t for t in added if "semantic" not in t["content"]])
    error = _expect_error(tmp_path, S2_TYPE, "tokenizer.json")
    assert "semantic" in str(error)


def test_hf_without_im_end(tmp_path: Path) -> None:
    _write_modified_s2(tmp_path, lambda added: [t for t in added if t["content"] != "<|im_end|>"])
    assert "<|im_end|>" in str(_expect_error(tmp_path, S2_TYPE, "tokenizer.json"))


def _swap_semantic_5_and_6(added: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_name = {t["content"]: t for t in added}
    five, six = by_name["<|semantic:5|>"], by_name["<|semantic:6|>"]
    five["content"], six["content"] = six["content"], five["content"]
    return added


def test_hf_non_contiguous_semantic(tmp_path: Path) -> None:
    _write_modified_s2(tmp_path, _swap_semantic_5_and_6)
    assert "contiguous" in str(_expect_error(tmp_path, S2_TYPE, "tokenizer.json"))


def test_hf_semantic_index_missing(tmp_path: Path) -> None:
    _write_modified_s2(tmp_path, lambda added: [t for t in added if t["content"] != "<|semantic:10|>"])
    assert "<|semantic:10|>" in str(_expect_error(tmp_path, S2_TYPE, "tokenizer.json"))


def test_s1_without_semantic_tokens(tmp_path: Path) -> None:
    named = {k: v for k, v in _golden_s1_special().items() if "semantic" not in k}
    _copy_s1(tmp_path, named)
    assert "semantic" in str(_expect_error(tmp_path, S1_TYPE, "special_tokens.json"))


def test_s1_semantic_out_of_order(tmp_path: Path) -> None:
    names = list(_golden_s1_special())
    five = names.index("<|semantic:5|>")
    names[five], names[five + 1] = names[five + 1], names[five]
    _copy_s1(tmp_path, {name: 0 for name in names})
    assert "contiguous" in str(_expect_error(tmp_path, S1_TYPE, "special_tokens.json"))


def _tree_digest(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


def test_random_s2_release_sizes(tmp_path: Path) -> None:
    ids = write_s2_tokenizer(tmp_path, num_base_tokens=151643, vocab_size=155776, num_semantic=4096)
    assert ids["im_end"] == 151645
    assert ids["pad"] == 151669
    assert ids["voice"] == 151673
    assert ids["audio_pad"] == 151677
    assert (ids["semantic_begin"], ids["semantic_end"]) == (151678, 155773)
    written = {p.name for p in tmp_path.iterdir()}
    assert written == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}
    tok = load_tokenizer(tmp_path, S2_TYPE)
    assert (tok.im_end_id, tok.pad_id, tok.voice_id) == (151645, 151669, 151673)
    assert (tok.semantic_begin_id, tok.semantic_end_id, tok.num_semantic) == (151678, 155773, 4096)
    assert tok.special["<|audio_pad|>"] == 151677
    assert tok.num_tokens == 155774 <= 155776
    assert tok.encode("<|im_start|>user\n<|voice|><|semantic:3|><|im_end|>")[-3:] == [151673, 151681, 151645]
    _check_plausible_bpe(tok)


def test_random_s1_release_sizes(tmp_path: Path) -> None:
    ids = write_s1_tokenizer(tmp_path, num_ranks=151643, num_semantic=4096)
    assert ids["im_end"] == 151647
    assert (ids["semantic_begin"], ids["semantic_end"]) == (151658, 155753)
    assert {p.name for p in tmp_path.iterdir()} == {"tokenizer.tiktoken", "special_tokens.json"}
    tok = load_tokenizer(tmp_path, S1_TYPE)
    assert tok.im_end_id == 151647
    assert (tok.semantic_begin_id, tok.semantic_end_id, tok.num_semantic) == (151658, 155753, 4096)
    assert tok.num_tokens == 155754
    assert tok.encode("<|interleave|><|speaker:0|>hi<|semantic:0|>")[0] == 151654
    assert tok.encode("<|semantic:0|>") == [151658]
    _check_plausible_bpe(tok)


def _check_plausible_bpe(tok: FishTokenizer) -> None:
    text = "Hello there! This is a tiny test of the speech model. How are you doing today?"
    ids = tok.encode(text)
    assert len(ids) < len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    odd = "Grüße, 東京 ✓\n\ttab"
    assert tok.decode(tok.encode(odd)) == odd


def test_random_s2_small_matches_golden_ids(tmp_path: Path, s2: FishTokenizer) -> None:
    ids = write_s2_tokenizer(tmp_path, num_base_tokens=411, vocab_size=512, num_semantic=64)
    assert (ids["im_end"], ids["voice"], ids["semantic_begin"], ids["semantic_end"]) == (413, 441, 446, 509)
    tok = load_tokenizer(tmp_path, S2_TYPE)
    assert dict(tok.special) == dict(s2.special)
    assert tok.num_tokens == s2.num_tokens
    # Same normalizer / pre-tokenizer / decoder, and byte tokens in the same id order, as the golden file.
    mine = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    golden = json.loads((S2_DIR / "tokenizer.json").read_text(encoding="utf-8"))
    for key in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        assert mine[key] == golden[key]
    model_options = {k: v for k, v in golden["model"].items() if k not in ("vocab", "merges")}
    assert {k: v for k, v in mine["model"].items() if k not in ("vocab", "merges")} == model_options
    assert list(mine["model"]["vocab"].items())[:256] == list(golden["model"]["vocab"].items())[:256]
    assert mine["added_tokens"] == golden["added_tokens"]
    assert tok.encode("cafe\u0301") == tok.encode("café")  # NFC applied


def test_random_s1_small_matches_golden_ids(tmp_path: Path, s1: FishTokenizer) -> None:
    ids = write_s1_tokenizer(tmp_path, num_ranks=433, num_semantic=64)
    assert (ids["im_end"], ids["interleave"]) == (437, 444)
    assert (ids["semantic_begin"], ids["semantic_end"]) == (448, 511)
    tok = load_tokenizer(tmp_path, S1_TYPE)
    assert dict(tok.special) == dict(s1.special)
    assert tok.num_tokens == s1.num_tokens
    written = json.loads((tmp_path / "special_tokens.json").read_text(encoding="utf-8"))
    assert list(written.items()) == list(_golden_s1_special().items())
    mine_lines = (tmp_path / "tokenizer.tiktoken").read_text(encoding="ascii").splitlines()
    golden_lines = (S1_DIR / "tokenizer.tiktoken").read_text(encoding="ascii").splitlines()
    assert len(mine_lines) == len(golden_lines) == 433
    assert mine_lines[:256] == golden_lines[:256]


def test_random_writers_are_deterministic(tmp_path: Path) -> None:
    for run in ("a", "b"):
        write_s2_tokenizer(tmp_path / run / "s2", num_base_tokens=2000, vocab_size=2304, num_semantic=128)
        write_s1_tokenizer(tmp_path / run / "s1", num_ranks=2000, num_semantic=128)
    for fmt in ("s2", "s1"):
        assert _tree_digest(tmp_path / "a" / fmt) == _tree_digest(tmp_path / "b" / fmt)


def test_random_writers_reject_bad_sizes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        write_s2_tokenizer(tmp_path, num_base_tokens=151643, vocab_size=155000, num_semantic=4096)
    with pytest.raises(ValueError, match="256"):
        write_s1_tokenizer(tmp_path, num_ranks=100, num_semantic=64)
    with pytest.raises(ValueError, match="num_semantic"):
        write_s2_tokenizer(tmp_path, num_base_tokens=411, vocab_size=512, num_semantic=0)
