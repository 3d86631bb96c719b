"""Checkpoint loading: both release layouts, dtype on demand, and clear errors for every kind of wrong checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rtts.model.config import DualARConfig
from rtts.model.errors import CheckpointError
from rtts.model.loading import load_model

S2_FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
S1_FILES = ["config.json", "model.pth", "tokenizer.tiktoken", "special_tokens.json"]


def _copy(src: Path, dst: Path, files: list[str]) -> Path:
    dst.mkdir()
    for f in files:
        shutil.copy(src / f, dst / f)
    return dst


@pytest.fixture
def s2_dir(golden: Path, tmp_path: Path) -> Path:
    return _copy(golden / "tiny-s2", tmp_path / "s2", S2_FILES)


@pytest.fixture
def s1_dir(golden: Path, tmp_path: Path) -> Path:
    return _copy(golden / "tiny-s1", tmp_path / "s1", S1_FILES)


def _edit_safetensors(path: Path, fn) -> None:  # type: ignore[no-untyped-def]
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path)


def _error(ckpt: Path) -> CheckpointError:
    with pytest.raises(CheckpointError) as e:
        load_model(ckpt)
    return e.value


def test_missing_tensor_names_file_and_tensor(s2_dir: Path) -> None:
    _edit_safetensors(s2_dir / "model.safetensors", lambda t: t.pop("text_model.model.layers.1.attention.wo.weight"))
    msg = str(_error(s2_dir))
    assert "model.safetensors" in msg and "layers.1.attention.wo.weight" in msg and "missing" in msg


def test_wrong_shape_names_file_and_tensor(s2_dir: Path) -> None:
    key = "audio_decoder.layers.0.feed_forward.w1.weight"
    _edit_safetensors(s2_dir / "model.safetensors", lambda t: t.__setitem__(key, torch.zeros(127, 64)))
    msg = str(_error(s2_dir))
    assert "model.safetensors" in msg and key in msg and "[127, 64]" in msg and "[128, 64]" in msg


def test_unexpected_tensor_is_refused(s2_dir: Path) -> None:
    _edit_safetensors(s2_dir / "model.safetensors", lambda t: t.__setitem__("text_model.model.extra.weight",
                                                                            torch.zeros(3)))
    assert "text_model.model.extra.weight" in str(_error(s2_dir))


def test_unknown_model_type(s2_dir: Path) -> None:
    cfg = json.loads((s2_dir / "config.json").read_text())
    cfg["model_type"] = "llama"
    (s2_dir / "config.json").write_text(json.dumps(cfg))
    msg = str(_error(s2_dir))
    assert "config.json" in msg and "llama" in msg


def test_missing_config_section(s2_dir: Path) -> None:
    cfg = json.loads((s2_dir / "config.json").read_text())
    del cfg["audio_decoder_config"]
    (s2_dir / "config.json").write_text(json.dumps(cfg))
    assert "audio_decoder_config" in str(_error(s2_dir))


def test_tokenizer_disagreeing_with_config(s2_dir: Path) -> None:
    cfg = json.loads((s2_dir / "config.json").read_text())
    cfg["semantic_start_token_id"] = 447
    (s2_dir / "config.json").write_text(json.dumps(cfg))
    msg = str(_error(s2_dir))
    assert "tokenizer.json" in msg and "semantic_start_token_id" in msg


def test_tokenizer_larger_than_vocab(s2_dir: Path) -> None:
    cfg = json.loads((s2_dir / "config.json").read_text())
    cfg["text_config"]["vocab_size"] = 500
    (s2_dir / "config.json").write_text(json.dumps(cfg))
    assert "vocab_size" in str(_error(s2_dir))


def test_garbage_weights_file(s2_dir: Path) -> None:
    (s2_dir / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    assert "model.safetensors" in str(_error(s2_dir))


def test_missing_shard(tiny_s2_sharded: Path, tmp_path: Path) -> None:
    files = ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors", "tokenizer.json"]
    d = _copy(tiny_s2_sharded, tmp_path / "sh", files)
    assert "model-00002-of-00002.safetensors" in str(_error(d))


def test_no_weights(tmp_path: Path, golden: Path) -> None:
    d = _copy(golden / "tiny-s2", tmp_path / "nw", ["config.json", "tokenizer.json"])
    assert "no weights" in str(_error(d))


def test_not_a_directory(tmp_path: Path) -> None:
    assert "not found" in str(_error(tmp_path / "nope"))


def test_bf16_on_demand(golden: Path) -> None:
    lm = load_model(golden / "tiny-s2", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    assert not any(p.is_meta for p in lm.model.parameters())


def test_s1_wrapped_prefixed_and_split_qkv_load_identically(s1_dir: Path, golden: Path) -> None:
    ref = load_model(golden / "tiny-s1").model.state_dict()
    sd = torch.load(s1_dir / "model.pth", weights_only=True)
    alt: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if k.endswith("attention.wqkv.weight"):  # spell layer 0 the old way: separate q/k/v projections
            base = k[: -len("wqkv.weight")]
            cfg = DualARConfig.from_file(s1_dir)
            fast = k.startswith("fast_")
            q = (cfg.fast_q_size if fast else cfg.q_size)
            kv = (cfg.fast_kv_size if fast else cfg.kv_size)
            wq, wk, wv = v.split([q, kv, kv])
            alt["model." + base + "wq.weight"], alt["model." + base + "wk.weight"] = wq, wk
            alt["model." + base + "wv.weight"] = wv
        else:
            alt["model." + k] = v
    alt["model.audio_projector.weight"] = torch.zeros(2)  # dropped by the loader, like the reference
    torch.save({"state_dict": alt}, s1_dir / "model.pth")
    got = load_model(s1_dir).model.state_dict()
    assert got.keys() == ref.keys()
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def test_s1_missing_tensor(s1_dir: Path) -> None:
    sd = torch.load(s1_dir / "model.pth", weights_only=True)
    del sd["output.weight"]
    torch.save(sd, s1_dir / "model.pth")
    msg = str(_error(s1_dir))
    assert "model.pth" in msg and "output.weight" in msg


def test_s1_rejects_norm_fastlayer_input(s1_dir: Path) -> None:
    cfg = json.loads((s1_dir / "config.json").read_text())
    cfg["norm_fastlayer_input"] = True
    (s1_dir / "config.json").write_text(json.dumps(cfg))
    assert "norm_fastlayer_input" in str(_error(s1_dir))
