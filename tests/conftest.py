"""Shared test fixtures: the golden reference outputs (vendored in tests/golden, plus the files derived from them at
test time), the GPU marker's deselection, the kernel switches the kernel tests change, and the live server the server
tests share (test_ws_*.py, test_http_tts.py, test_references.py, test_model_api.py, test_sdk.py, ...)."""

from __future__ import annotations

import json
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import soundfile as sf
import torch
from safetensors.torch import load_file, save_file

from rtts import env

if TYPE_CHECKING:  # the web stack is imported only when a server test runs
    from liveserver import LiveServer
    from websockets.sync.client import ClientConnection

    from rtts.runtime import ServerConfig

# The vendored fixtures (tests/golden/README.md); RTTS_GOLDEN_DIR points the tests at another copy.
GOLDEN = Path(os.environ.get("RTTS_GOLDEN_DIR", Path(__file__).resolve().parent / "golden"))

# The two release spellings of a weight-normed conv's (g, v) pair: codec.pth stores most convs parametrized.
_PARAMETRIZED = (".parametrizations.weight.original0", ".parametrizations.weight.original1")
_LEGACY = (".weight_g", ".weight_v")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without CUDA the `gpu` tests are deselected (counted once in the summary), not listed as skips one by one."""
    if torch.cuda.is_available():
        return
    gpu = [item for item in items if "gpu" in item.keywords]
    if gpu:
        items[:] = [item for item in items if "gpu" not in item.keywords]
        config.hook.pytest_deselected(items=gpu)


def system_tool(name: str) -> str:
    """The path of a system program a test drives (haproxy, chromium, ffmpeg). Missing: the test skips, except where
    RTTS_REQUIRE_SYSTEM_TOOLS=1 (.ci/run installs them and sets it), where it fails, so CI never passes by skipping."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("RTTS_REQUIRE_SYSTEM_TOOLS") == "1":
            pytest.fail(f"{name} is not installed (.ci/run installs it with apt-get)")
        pytest.skip(f"{name} is not installed")
    return path


@pytest.fixture(scope="session")
def golden() -> Path:
    """The golden fixture root. Missing fixtures fail the test (they are part of CI), never skip it silently."""
    if not GOLDEN.is_dir():
        pytest.fail(f"golden fixtures not found at {GOLDEN} (set RTTS_GOLDEN_DIR)")
    return GOLDEN


# ---------------------------------------------------------------------------------------- derived golden files
# Files that are a re-encoding of vendored ones are built once per run instead of stored (each was checked byte for
# byte against the reference implementation's own copy when the fixtures were vendored).


@pytest.fixture(scope="session")
def tiny_s2_sharded(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-s2 with its weights in two safetensors shards (text model, then audio decoder) and an index."""
    src, out = golden / "tiny-s2", tmp_path_factory.mktemp("golden") / "tiny-s2-sharded"
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(src / name, out / name)
    weights = load_file(src / "model.safetensors")
    weight_map: dict[str, str] = {}
    for i, prefix in enumerate(("text_model.", "audio_decoder."), start=1):
        fname = f"model-{i:05d}-of-00002.safetensors"
        shard = {k: v for k, v in weights.items() if k.startswith(prefix)}
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    assert weight_map.keys() == weights.keys()
    metadata = {"total_size": sum(v.numel() * v.element_size() for v in weights.values()),
                "total_parameters": sum(v.numel() for v in weights.values())}
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


@pytest.fixture(scope="session")
def tiny_s2_legacy_codec(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-s2's codec as a training checkpoint: {"state_dict": {"generator." + key}}, every weight-normed conv
    spelled weight_g/weight_v, without the stale RoPE/mask buffers, plus two discriminator tensors to be ignored.
    Beside it a copy of codec_config.json, which load_codec reads from the file's directory."""
    src, out = golden / "tiny-s2", tmp_path_factory.mktemp("golden")
    shutil.copyfile(src / "codec_config.json", out / "codec_config.json")
    sd = torch.load(src / "codec.pth", map_location="cpu", weights_only=True)
    legacy: OrderedDict[str, torch.Tensor] = OrderedDict()  # as the training code saved it
    for key, tensor in sd.items():
        if key.endswith(("freqs_cis", "causal_mask")):
            continue
        for param, old in zip(_PARAMETRIZED, _LEGACY):
            key = key.replace(param, old)
        legacy["generator." + key] = tensor
    legacy["discriminator.mpd.0.conv.weight"] = torch.zeros(2, 1, 3)
    legacy["discriminator.mpd.0.conv.bias"] = torch.zeros(2)
    path = out / "codec_legacy_wn.pth"
    torch.save({"state_dict": legacy}, path)
    return path


@pytest.fixture(scope="session")
def encode1s_wav(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-s2's `codec/encode1s.signal.npy` as a mono IEEE-float32 WAV at 44.1 kHz."""
    path = tmp_path_factory.mktemp("golden") / "encode1s.signal.wav"
    sf.write(path, np.load(golden / "tiny-s2" / "fixtures" / "codec" / "encode1s.signal.npy"), 44100, subtype="FLOAT")
    return path


# ------------------------------------------------------------------------------------------------ the live server
# Limits of the shared `srv`, lowered so that every limit can be hit cheaply.
MAX_TEXT = 2000
MAX_SESSION_TEXT = 5000
MAX_MESSAGE = 1 << 20
MAX_REFERENCE = 1 << 20  # bytes of one reference clip (the golden one is far smaller)
MAX_REF_SECONDS = 3.0
REF_TEXT = "The quick brown fox jumps over the lazy dog."
LONG_TEXT = " ".join(f"Sentence number {i} keeps the model busy for a while." for i in range(12))


def tiny_config(golden: Path, voices_dir: Path, **kw: Any) -> ServerConfig:
    """A server on the tiny golden checkpoint (CPU): a free port, 4 slots, voices in `voices_dir`; `kw` overrides."""
    from liveserver import free_port

    from rtts.runtime import ServerConfig

    base: dict[str, Any] = dict(checkpoint=str(golden / "tiny-s2"), port=free_port(), max_running=4, max_ctx=2048,
                                voices_dir=str(voices_dir))
    return ServerConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def srv(golden: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The open server (no API keys) of a test module, with the lowered limits above."""
    from liveserver import LiveServer

    from rtts.request import Limits

    s = LiveServer(tiny_config(
        golden, tmp_path_factory.mktemp("voices"), max_reference_seconds=MAX_REF_SECONDS,
        limits=Limits(max_text_chars=MAX_TEXT, max_session_text_chars=MAX_SESSION_TEXT, max_message_bytes=MAX_MESSAGE,
                      max_reference_bytes=MAX_REFERENCE),
    ))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref_wav(golden: Path) -> bytes:
    """A 1 s reference clip (WAV bytes) for voice cloning."""
    from liveserver import reference_wav

    return reference_wav(golden)


@pytest.fixture
def ws(srv: LiveServer) -> Iterator[ClientConnection]:
    """A raw client socket on `srv`; the server is idle again after the test."""
    with srv.connect() as c:
        yield c
    srv.wait_idle()


def greedy(**kw: Any) -> dict[str, Any]:
    """A start request that decides every token by argmax (top_k 1): the same audio every time."""
    return {"top_k": 1, "temperature": 0.7, "top_p": 0.7, "seed": 0, "max_new_tokens": 40, **kw}


def s16(data: bytes) -> np.ndarray:
    """PCM bytes as int16 samples."""
    assert len(data) % 2 == 0
    return np.frombuffer(data, dtype="<i2")


def metric(srv: LiveServer, name: str) -> float:
    """The value of an unlabelled metric on `srv`'s /metrics."""
    import httpx

    text = httpx.get(srv.http + "/metrics").text
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[-1])


# ------------------------------------------------------------------------------------------- the kernel switches


@pytest.fixture
def switches() -> Iterator[Callable[..., object]]:
    """switches(name=value, ...) changes kernel switches (env.KernelSwitches fields) for the rest of the test."""
    saved = env.kernel_switches()
    yield env.change_kernel_switches
    env.set_kernel_switches(saved)
