"""ModifiedDAC codec vs the golden fixtures: decode, encode, exact streaming, loading and its failures."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from conftest import GOLDEN  # one place decides where the fixtures are

from rtts.model.codec import (
    STALE_BUFFERS,
    Codec,
    CodecConfig,
    codec_state_dict_keys,
    load_codec,
    random_codec_state_dict,
)
from rtts.model.errors import CheckpointError

S2_DIR = GOLDEN / "tiny-s2"
S1_DIR = GOLDEN / "tiny-s1"
S2_CODEC = S2_DIR / "fixtures" / "codec"
S1_CODEC = S1_DIR / "fixtures" / "codec"
WAV_TOL = 1e-4  # README §10: codec waveforms and intermediates, float32 vs float32

pytestmark = pytest.mark.usefixtures("golden")  # fails loudly when the fixtures are missing


@pytest.fixture(scope="module", autouse=True)
def _single_thread() -> Iterator[None]:
    # The tiny codec's ops are far too small to gain from intra-op threads; with other processes on the
    # same 2 cores, OpenMP barriers made this file ~10x slower (8 s -> 70 s). Restored afterwards.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _np(path: Path) -> torch.Tensor:
    return torch.from_numpy(np.load(path))


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


@pytest.fixture(scope="module")
def s2() -> Codec:
    return load_codec(S2_DIR)


@pytest.fixture(scope="module")
def s1() -> Codec:
    return load_codec(S1_DIR)


@pytest.fixture(scope="module")
def long_codes() -> torch.Tensor:
    return _np(S2_CODEC / "decode_long.codes.npy")[None]  # [1, 10, 140]


@pytest.fixture(scope="module")
def long_wav(s2: Codec, long_codes: torch.Tensor) -> torch.Tensor:
    return s2.decode(long_codes)  # [1, 140 * 2048]


# ---------------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------------


def test_config_from_json() -> None:
    s2 = CodecConfig.from_json(S2_DIR / "codec_config.json")
    assert (s2.latent_dim, s2.decoder_dim, s2.encoder_dim) == (64, 64, 4)
    assert (s2.semantic_codebook_size, s2.codebook_size, s2.n_codebooks, s2.num_codebooks) == (64, 32, 9, 10)
    assert s2.encoder_transformer.n_layer == 2 and s2.encoder_transformer.window_size == 512
    assert s2.post_module.window_size == 128 and s2.post_module.head_dim == 16
    assert CodecConfig.from_json(S1_DIR / "codec_config.json").encoder_transformer.n_layer == 1


def test_release_config() -> None:
    cfg = CodecConfig.release()
    assert cfg.frame_length == 2048 and cfg.hop_length == 512 and cfg.num_codebooks == 10
    assert (cfg.semantic_codebook_size, cfg.codebook_size, cfg.codebook_dim) == (4096, 1024, 8)
    assert cfg.post_module.n_layer == 8 and cfg.encoder_transformer.n_layer == 4


def test_config_rejects_other_encoder_window(tmp_path: Path) -> None:
    raw = json.loads((S2_DIR / "codec_config.json").read_text())
    raw["encoder_transformer"]["window_size"] = 64
    (tmp_path / "codec_config.json").write_text(json.dumps(raw))
    # NOTE: the reference ignores this field (always 512), so the loader does too.
    assert CodecConfig.from_json(tmp_path / "codec_config.json").encoder_transformer.window_size == 512
    del raw["latent_dim"]
    (tmp_path / "codec_config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="latent_dim"):
        CodecConfig.from_json(tmp_path / "codec_config.json")


# ---------------------------------------------------------------------------------------------------
# Decode
# ---------------------------------------------------------------------------------------------------


def test_decode16_and_intermediates(s2: Codec) -> None:
    codes = _np(S2_CODEC / "decode16.codes.npy")[None]
    with torch.no_grad():
        zq = s2.codes_to_latent(codes)
        post = s2.quantizer.post_module(zq)
        up = s2.quantizer.upsample(post)
    assert _max_diff(zq[0], _np(S2_CODEC / "decode16.zq.npy")) <= WAV_TOL
    assert _max_diff(post[0], _np(S2_CODEC / "decode16.post.npy")) <= WAV_TOL
    assert _max_diff(up[0], _np(S2_CODEC / "decode16.upsampled.npy")) <= WAV_TOL
    wav = s2.decode(codes)
    assert wav.dtype == torch.float32 and wav.shape == (1, 16 * 2048)
    assert _max_diff(wav[0], _np(S2_CODEC / "decode16.wav.npy")) <= WAV_TOL  # measured ~6e-06
    first8 = s2.decode(codes[..., :8])
    assert _max_diff(first8[0], _np(S2_CODEC / "decode16.first8.wav.npy")) <= WAV_TOL


def test_decode_long(s2: Codec, long_codes: torch.Tensor, long_wav: torch.Tensor) -> None:
    # 140 frames > the post transformer's 128-frame window
    with torch.no_grad():
        post = s2.quantizer.post_module(s2.codes_to_latent(long_codes))
    assert _max_diff(post[0], _np(S2_CODEC / "decode_long.post.npy")) <= WAV_TOL
    assert _max_diff(long_wav[0], _np(S2_CODEC / "decode_long.wav.npy")) <= WAV_TOL  # measured ~5e-06


def test_decode_out_of_range_codes_clamp(s2: Codec) -> None:
    codes = _np(S2_CODEC / "decode_oob.codes.npy")[None]
    before = codes.clone()
    wav = s2.decode(codes)
    assert torch.equal(codes, before), "decode must not clamp the caller's tensor in place"
    assert _max_diff(wav[0], _np(S2_CODEC / "decode_oob.wav.npy")) <= WAV_TOL
    negative = codes.clone()
    negative[:, :, 3] = -5
    zeroed = codes.clone()
    zeroed[:, :, 3] = 0
    assert torch.equal(s2.decode(negative), s2.decode(zeroed))


def _case_codes(root: Path) -> list[Path]:
    return sorted(root.glob("fixtures/*/b*.codes.npy"))


@pytest.mark.parametrize("set_dir", [S2_DIR, S1_DIR], ids=["tiny-s2", "tiny-s1"])
def test_decode_generated_cases(set_dir: Path, s2: Codec, s1: Codec) -> None:
    codec = s2 if set_dir == S2_DIR else s1
    files = _case_codes(set_dir)
    assert len(files) >= 4
    for codes_file in files:
        expected = _np(codes_file.with_name(codes_file.name.replace(".codes.npy", ".codes_decoded.wav.npy")))
        wav = codec.decode(_np(codes_file)[None])  # residual ids >= 32 from the 64-way fast head get clamped
        assert _max_diff(wav[0], expected) <= WAV_TOL, codes_file


def test_s1_decode16(s1: Codec) -> None:
    wav = s1.decode(_np(S1_CODEC / "decode16.codes.npy")[None])
    assert _max_diff(wav[0], _np(S1_CODEC / "decode16.wav.npy")) <= WAV_TOL


# ---------------------------------------------------------------------------------------------------
# Encode
# ---------------------------------------------------------------------------------------------------


def test_encode1s_and_intermediates(s2: Codec) -> None:
    signal = _np(S2_CODEC / "encode1s.signal.npy")[None]
    codes = s2.encode(signal)
    assert codes.dtype == torch.int64 and codes.shape == (1, 10, 22)  # ceil(44100 / 2048)
    assert torch.equal(codes[0], _np(S2_CODEC / "encode1s.codes.npy"))
    with torch.no_grad():
        enc = s2.encoder(s2.pad_audio(signal))
        pre = s2.quantizer.pre_module(s2.quantizer.downsample(enc))
        _, z_e = s2.quantizer.quantize(pre)
    assert _max_diff(enc[0], _np(S2_CODEC / "encode1s.encoder_out.npy")) <= WAV_TOL
    assert _max_diff(pre[0], _np(S2_CODEC / "encode1s.pre_module_out.npy")) <= WAV_TOL
    assert _max_diff(z_e[0], _np(S2_CODEC / "encode1s.z_e.npy")) <= WAV_TOL


def test_encode_from_wav_file(s2: Codec, encode1s_wav: Path) -> None:
    audio, rate = sf.read(encode1s_wav, dtype="float32")
    assert rate == s2.config.sample_rate and audio.ndim == 1
    codes = s2.encode(torch.from_numpy(audio)[None])
    assert torch.equal(codes[0], _np(S2_CODEC / "encode1s.codes.npy"))


def test_encode_long(s2: Codec) -> None:
    # 560 encoder steps > the encoder transformer's 512 window; 140 frames > the pre module's 128.
    # Exact equality holds everywhere, including the smallest cosine margin (8.1e-05).
    signal = _np(S2_CODEC / "encode_long.signal.npy")[None]
    codes = s2.encode(signal)
    assert torch.equal(codes[0], _np(S2_CODEC / "encode_long.codes.npy"))
    with torch.no_grad():
        pre = s2.quantizer.pre_module(s2.quantizer.downsample(s2.encoder(s2.pad_audio(signal))))
    assert _max_diff(pre[0], _np(S2_CODEC / "encode_long.pre_module_out.npy")) <= WAV_TOL


def test_s1_encode1s(s1: Codec) -> None:
    codes = s1.encode(_np(S1_CODEC / "encode1s.signal.npy")[None])
    assert torch.equal(codes[0], _np(S1_CODEC / "encode1s.codes.npy"))


def test_encode_batch_matches_single(s2: Codec) -> None:
    signal = _np(S2_CODEC / "encode1s.signal.npy")
    batch = torch.stack([signal, signal.flip(0) * 0.5])
    codes = s2.encode(batch)
    assert torch.equal(codes[0], _np(S2_CODEC / "encode1s.codes.npy"))
    assert torch.equal(codes[1], s2.encode(batch[1:])[0])


# ---------------------------------------------------------------------------------------------------
# Streaming decode
# ---------------------------------------------------------------------------------------------------


def _stream(
    codec: Codec, codes: torch.Tensor, sizes: list[int], capacity: int = 1, slot: int = 0
) -> torch.Tensor:
    # codes: [1, 10, T] -> [1, T * 2048], decoded chunk by chunk into `slot`
    state = codec.new_stream_state(capacity)
    slots = torch.tensor([slot])
    out, start = [], 0
    for size in sizes:
        out.append(codec.decode_stream(codes[..., start : start + size], state, slots))
        start += size
    assert start == codes.shape[-1]
    assert state.pos.tolist() == [start if i == slot else 0 for i in range(capacity)]
    return torch.cat(out, dim=-1)


@pytest.mark.parametrize(
    "sizes",
    [[1] * 140, [3] * 46 + [2], [5, 1, 2, 17, 30, 1, 64, 20]],
    ids=["1-frame", "3-frame", "uneven"],
)
def test_stream_equals_whole_decode(
    s2: Codec, long_codes: torch.Tensor, long_wav: torch.Tensor, sizes: list[int]
) -> None:
    # Measured max |diff| vs decode(): ~6e-06 for every chunking (the decoder convs run on different
    # lengths, so oneDNN may block the sums differently); vs the fixture: same order.
    streamed = _stream(s2, long_codes, sizes, capacity=3, slot=2)
    assert _max_diff(streamed, long_wav) <= WAV_TOL
    assert _max_diff(streamed[0], _np(S2_CODEC / "decode_long.wav.npy")) <= WAV_TOL


def test_stream_slots_are_independent(s2: Codec, long_codes: torch.Tensor) -> None:
    a, b = long_codes[..., :24], long_codes[..., 60:84].flip(-1)
    want_a, want_b = s2.decode(a), s2.decode(b)

    # Separate, interleaved calls with different chunkings.
    state = s2.new_stream_state(4)
    out_a, out_b = [], []
    for i in range(8):
        out_a.append(s2.decode_stream(a[..., 3 * i : 3 * i + 3], state, torch.tensor([0])))
        for j in (2 * i, 2 * i + 1):
            if j < 12:
                out_b.append(s2.decode_stream(b[..., 2 * j : 2 * j + 2], state, torch.tensor([3])))
    assert _max_diff(torch.cat(out_a, -1), want_a) <= WAV_TOL
    assert _max_diff(torch.cat(out_b, -1), want_b) <= WAV_TOL
    assert state.pos.tolist() == [24, 0, 0, 24]

    # One batched call per chunk, slots listed out of order.
    state = s2.new_stream_state(4)
    both = torch.cat([b, a])
    out = [s2.decode_stream(both[..., i : i + 4], state, torch.tensor([3, 1])) for i in range(0, 24, 4)]
    out_t = torch.cat(out, -1)
    assert _max_diff(out_t[1:], want_a) <= WAV_TOL and _max_diff(out_t[:1], want_b) <= WAV_TOL
    # Batched and single-slot runs agree to float rounding of different batch shapes.
    assert _max_diff(out_t[1:], torch.cat(out_a, -1)) <= 1e-5


def test_stream_padding_rows_on_a_scratch_slot_change_no_real_row(s2: Codec, long_codes: torch.Tensor) -> None:
    """What the codec graphs rely on (engine/graphs/codec.py): rows padded onto one scratch slot, even several
    at once and with any codes, leave the real rows' audio and state as an unpadded call leaves them."""
    a, b = long_codes[..., :12], long_codes[..., 40:52]
    plain, padded = s2.new_stream_state(5), s2.new_stream_state(5)
    junk = torch.randint(0, 4096, (3, 10, 12), generator=torch.Generator().manual_seed(1))
    for i in range(0, 12, 4):
        want = s2.decode_stream(torch.cat([a, b])[..., i : i + 4], plain, torch.tensor([0, 2]))
        got = s2.decode_stream(torch.cat([a, b, junk])[..., i : i + 4], padded, torch.tensor([0, 2, 4, 4, 4]))
        assert _max_diff(got[:2], want) <= 1e-5
    for x, y in zip((*padded.tails, padded.kv), (*plain.tails, plain.kv)):
        assert _max_diff(x[:4], y[:4]) <= 1e-5
    assert padded.pos.tolist()[:4] == plain.pos.tolist()[:4] == [12, 0, 12, 0]


def test_codec_graph_runner_plans_and_falls_back_to_the_eager_stream(s2: Codec, long_codes: torch.Tensor) -> None:
    from rtts.engine.graphs.codec import CodecGraphRunner, chunk_plan

    assert chunk_plan(11) == [8, 2, 1] and chunk_plan(1) == [1] and chunk_plan(16) == [8, 8] and chunk_plan(0) == []
    assert chunk_plan(7, (4, 1)) == [4, 1, 1, 1]
    state, ref = s2.new_stream_state(3), s2.new_stream_state(3)
    with pytest.raises(ValueError):
        CodecGraphRunner(s2, state, 2, 3)  # the scratch slot must be a row of the state
    with pytest.raises(ValueError):
        CodecGraphRunner(s2, state, 2, 2, chunks=(4, 2))
    runner = CodecGraphRunner(s2, state, 2, 2)  # not captured (CPU): decode is the eager stream
    assert not runner.graphs and runner.buckets == [1, 2]
    codes = long_codes[..., :5]
    got = runner.decode(codes, torch.tensor([1]))
    assert torch.equal(got, s2.decode_stream(codes, ref, torch.tensor([1])))
    assert state.pos.tolist() == ref.pos.tolist() == [0, 5, 0]


def test_stream_reset_reuses_slot(s2: Codec, long_codes: torch.Tensor) -> None:
    a, b = long_codes[..., :10], long_codes[..., 100:112]
    state = s2.new_stream_state(3)
    ptrs = [t.data_ptr() for t in (*state.tails, state.kv, state.pos)]
    s2.decode_stream(a, state, torch.tensor([1]))
    s2.decode_stream(a[..., :4], state, torch.tensor([2]))
    state.reset(torch.tensor([False, True, False]))
    assert state.pos.tolist() == [0, 0, 4]
    assert [t.data_ptr() for t in (*state.tails, state.kv, state.pos)] == ptrs, "reset must not reallocate"
    assert all(not t[1].any() for t in (*state.tails, state.kv))
    reused = torch.cat(
        [s2.decode_stream(b[..., i : i + 3], state, torch.tensor([1])) for i in range(0, 12, 3)], -1
    )
    assert _max_diff(reused, s2.decode(b)) <= WAV_TOL
    # The untouched slot 2 continues its own stream.
    rest = s2.decode_stream(a[..., 4:], state, torch.tensor([2]))
    assert _max_diff(rest, s2.decode(a)[:, 4 * 2048 :]) <= WAV_TOL


def test_stream_default_slots_and_clamp(s2: Codec) -> None:
    codes = _np(S2_CODEC / "decode_oob.codes.npy")[None]
    state = s2.new_stream_state(1)
    streamed = torch.cat([s2.decode_stream(codes[..., i : i + 4], state) for i in range(0, 16, 4)], -1)
    assert _max_diff(streamed[0], _np(S2_CODEC / "decode_oob.wav.npy")) <= WAV_TOL


def test_stream_state_follows_codec_dtype() -> None:
    codec = load_codec(S2_DIR, dtype=torch.bfloat16)
    state = codec.new_stream_state(2)
    assert all(t.dtype == torch.bfloat16 for t in (*state.tails, state.kv)) and state.pos.dtype == torch.int64
    codes = _np(S2_CODEC / "decode16.codes.npy")[None]
    whole = codec.decode(codes)
    streamed = torch.cat([codec.decode_stream(codes[..., i : i + 4], state) for i in range(0, 16, 4)], -1)
    assert whole.dtype == torch.bfloat16 and torch.isfinite(whole.float()).all()
    # bf16 keeps ~3 significant digits: only a loose agreement with the float32 reference is expected.
    ref = _np(S2_CODEC / "decode16.wav.npy")
    assert _max_diff(whole[0].float(), ref) < 0.1 and _max_diff(streamed.float(), whole.float()) < 0.1


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def test_legacy_weight_norm_file_loads_identically(s2: Codec, tiny_s2_legacy_codec: Path) -> None:
    # {"state_dict": {"generator." + key}} with weight_g/weight_v everywhere + discriminator tensors.
    legacy = load_codec(tiny_s2_legacy_codec)
    ours, theirs = s2.state_dict(), legacy.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    codes = _np(S2_CODEC / "decode16.codes.npy")[None]
    assert torch.equal(legacy.decode(codes), s2.decode(codes))


def test_s1_file_with_stale_buffers_loads(s1: Codec) -> None:
    raw = torch.load(S1_DIR / "codec.pth", map_location="cpu", weights_only=True)
    assert STALE_BUFFERS <= raw.keys()
    assert not any("freqs_cis" in k or "causal_mask" in k for k in s1.state_dict())


def test_layout_matches_files() -> None:
    for set_dir in (S2_DIR, S1_DIR):
        raw = torch.load(set_dir / "codec.pth", map_location="cpu", weights_only=True)
        on_disk = {k: tuple(v.shape) for k, v in raw.items() if k not in STALE_BUFFERS}
        assert codec_state_dict_keys(CodecConfig.from_json(set_dir / "codec_config.json")) == on_disk


def test_release_layout_counts() -> None:
    layout = codec_state_dict_keys(CodecConfig.release())
    param_g = [k for k in layout if k.endswith(".parametrizations.weight.original0")]
    legacy_g = [k for k in layout if k.endswith(".weight_g")]
    assert (len(param_g), len(legacy_g)) == (60, 20)
    # MODEL_SPEC §13.4: 455 weight tensors once each g/v pair counts as one fused weight (461 with the 6
    # stale buffers). On disk every weight-normed conv stores 2 tensors, so the file holds 455 + 80 = 535.
    assert len(layout) == 535
    assert len(layout) - len(param_g) - len(legacy_g) == 455
    assert layout["decoder.model.1.block.1.conv.parametrizations.weight.original0"] == (1536, 1, 1)
    assert layout["decoder.model.1.block.1.conv.parametrizations.weight.original1"] == (1536, 768, 16)
    assert layout["quantizer.semantic_quantizer.quantizers.0.codebook.weight"] == (4096, 8)
    assert layout["quantizer.post_module.layers.7.attention.wqkv.weight"] == (3072, 1024)
    assert layout["decoder.model.6.conv.parametrizations.weight.original1"] == (1, 96, 7)


def test_random_state_dict_round_trip(tmp_path: Path) -> None:
    cfg = CodecConfig.from_json(S2_DIR / "codec_config.json")
    sd = random_codec_state_dict(cfg, seed=3)
    assert {k: tuple(v.shape) for k, v in sd.items()} == codec_state_dict_keys(cfg)
    assert all(torch.equal(v, w) for v, w in zip(sd.values(), random_codec_state_dict(cfg, seed=3).values()))
    assert not torch.equal(
        sd["quantizer.quantizer.quantizers.0.codebook.weight"],
        random_codec_state_dict(cfg, seed=4)["quantizer.quantizer.quantizers.0.codebook.weight"],
    )
    torch.save(sd, tmp_path / "codec.pth")
    codec = load_codec(tmp_path, config=cfg)
    codes = torch.randint(0, 32, (2, 10, 6), generator=torch.Generator().manual_seed(0))
    wav = codec.decode(codes)
    assert wav.shape == (2, 6 * 2048) and torch.isfinite(wav).all()
    rms = wav.pow(2).mean().sqrt().item()
    assert 0.05 < rms < 0.9, f"random weights should give audible, unsaturated output (rms {rms})"
    # A well-conditioned random codec streams as exactly as the real one (a badly scaled one saturates
    # tanh and turns float rounding into O(1) differences).
    state = codec.new_stream_state(2)
    streamed = torch.cat([codec.decode_stream(codes[..., i : i + 1], state) for i in range(6)], -1)
    assert _max_diff(streamed, wav) <= WAV_TOL
    assert codec.encode(wav).shape == (2, 10, 6)


# ---------------------------------------------------------------------------------------------------
# Broken files
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s2_raw() -> dict[str, torch.Tensor]:
    return torch.load(S2_DIR / "codec.pth", map_location="cpu", weights_only=True)


def _broken(tmp_path: Path, sd: dict[str, torch.Tensor]) -> Path:
    path = tmp_path / "broken_codec.pth"
    torch.save(sd, path)
    return path


def _expect_error(path: Path, tensor: str | None, match: str) -> None:
    cfg = CodecConfig.from_json(S2_DIR / "codec_config.json")
    with pytest.raises(CheckpointError, match=match) as err:
        load_codec(path, config=cfg)
    assert path.name in str(err.value)
    if tensor is not None:
        assert tensor in str(err.value) and err.value.tensor == tensor


@pytest.mark.parametrize(
    "key",
    [
        "quantizer.quantizer.quantizers.3.codebook.weight",
        "decoder.model.6.conv.parametrizations.weight.original0",
        "quantizer.semantic_quantizer.quantizers.0.out_proj.weight_v",
    ],
)
def test_missing_tensor(tmp_path: Path, s2_raw: dict[str, torch.Tensor], key: str) -> None:
    sd = {k: v for k, v in s2_raw.items() if k != key}
    _expect_error(_broken(tmp_path, sd), key, "missing")


@pytest.mark.parametrize(
    "key",
    ["quantizer.post_module.norm.weight", "decoder.model.2.block.1.conv.parametrizations.weight.original1"],
)
def test_wrong_shape(tmp_path: Path, s2_raw: dict[str, torch.Tensor], key: str) -> None:
    sd = dict(s2_raw)
    sd[key] = sd[key][:-1]
    _expect_error(_broken(tmp_path, sd), key, "wrong shape")


def test_unexpected_tensor(tmp_path: Path, s2_raw: dict[str, torch.Tensor]) -> None:
    sd = dict(s2_raw)
    sd["decoder.model.9.conv.bias"] = torch.zeros(3)
    _expect_error(_broken(tmp_path, sd), "decoder.model.9.conv.bias", "unexpected")


def test_garbage_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage_codec.pth"
    path.write_bytes(b"this is not a pickle nor a zip archive\x00\x01")
    _expect_error(path, None, "cannot read")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found") as err:
        load_codec(tmp_path)  # a directory without codec.pth
    assert "codec.pth" in str(err.value)


def test_weight_norm_spelled_twice_or_pre_fused(tmp_path: Path, s2_raw: dict[str, torch.Tensor]) -> None:
    stem = "decoder.model.0.conv"
    sd = dict(s2_raw)
    sd[f"{stem}.weight_g"] = sd[f"{stem}.parametrizations.weight.original0"]
    _expect_error(_broken(tmp_path, sd), f"{stem}.weight_g", "twice")
    sd = {k: v for k, v in s2_raw.items() if not k.startswith(f"{stem}.parametrizations")}
    sd[f"{stem}.weight"] = s2_raw[f"{stem}.parametrizations.weight.original1"]
    _expect_error(_broken(tmp_path, sd), f"{stem}.weight", "weight-normed")
