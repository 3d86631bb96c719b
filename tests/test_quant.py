"""`rtts quantize` and the FP8 serving path: saved-file layout, per-layer accuracy, and the FP8-vs-bf16 gate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from rtts.__main__ import main
from rtts.bench.gate import NOISE_FACTOR, FrameTrace, compare_frame, judge, make_demo, run_gate
from rtts.model.loading import load_model
from rtts.model.quant import FP8FeedForward, FP8Linear


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_demo(tmp_path_factory.mktemp("gate"))


def test_quantized_file_layout(demo: tuple[Path, Path]) -> None:
    src, dst = demo
    assert json.loads((dst / "config.json").read_text())["quantization"] == {"method": "fp8_block", "block": [128, 128]}
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        w = f.get_tensor("text_model.model.layers.0.attention.wqkv.weight")
        s = f.get_tensor("text_model.model.layers.0.attention.wqkv.weight_scale")
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
        assert s.shape == (w.shape[0] // 128, w.shape[1] // 128)
        assert "audio_decoder.layers.1.feed_forward.w2.weight_scale" in keys
        assert f.get_tensor("text_model.model.embeddings.weight").dtype == torch.bfloat16
    for name in ("tokenizer.json", "codec.pth", "codec_config.json"):
        assert (dst / name).exists()


def test_every_quantized_layer_matches_bf16(demo: tuple[Path, Path]) -> None:
    """Scale-layout or stride bugs give wrong outputs at full speed: compare each FP8 layer with its bf16 source."""
    src, dst = demo
    ref, q = load_model(src, dtype=torch.bfloat16), load_model(dst, dtype=torch.bfloat16)
    ref_mods = dict(ref.model.named_modules())
    checked = 0
    for name, mod in q.model.named_modules():
        if not isinstance(mod, (FP8Linear, FP8FeedForward)) or name.endswith((".w1", ".w2", ".w3")):
            continue
        dense = ref_mods[name]
        x = torch.randn(5, mod.w1.in_features if isinstance(mod, FP8FeedForward) else mod.in_features,
                        generator=torch.Generator().manual_seed(checked)).to(torch.bfloat16)
        with torch.inference_mode():
            a, b = dense(x).float(), mod(x).float()
        rel = float((a - b).norm() / a.norm())
        assert rel < 0.08, f"{name}: relative error {rel:.3f}"
        checked += 1
    assert checked == 2 * (2 + 1) * 2  # (wqkv, wo, mlp) x layers x (slow, fast)


def test_packed_fp8_model_matches_unpacked(demo: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the GPU runs the wgmma GEMM, loading repacks every FP8 weight (gate|up fused, then packed; w1/w3 stay
    views of packed tiles). Forced on the CPU path, the packed model computes exactly what the [N, K] one does."""
    from rtts.kernels import gemm

    _, dst = demo
    plain = load_model(dst, dtype=torch.bfloat16)
    monkeypatch.setattr(gemm, "packs_weights", lambda device: True)  # what prepare_weight asks
    packed = load_model(dst, dtype=torch.bfloat16)
    mods = dict(plain.model.named_modules())
    seen = 0
    for name, mod in packed.model.named_modules():
        if isinstance(mod, FP8FeedForward):
            assert mod.gate_up is not None and mod.gate_up.dim() == 4 and mod.w2.weight.dim() == 4
            assert mod.w1.weight.data_ptr() == mod.gate_up.data_ptr() and mod.w3.weight.dim() == 4
            x = torch.randn(3, mod.w1.in_features, generator=torch.Generator().manual_seed(seen)).bfloat16()
        elif isinstance(mod, FP8Linear) and not name.endswith((".w1", ".w2", ".w3")):
            assert mod.weight.dim() == 4
            x = torch.randn(3, mod.in_features, generator=torch.Generator().manual_seed(seen)).bfloat16()
        else:
            continue
        with torch.inference_mode():
            assert torch.equal(mod(x), mods[name](x)), name
        seen += 1
    assert seen == 2 * (2 + 1) * 2


def test_gate_fp8_matches_bf16_greedy(demo: tuple[Path, Path]) -> None:
    r = run_gate(*demo)
    assert r.passed, r.failures
    assert len({tuple(c) for c in r.columns_bf16}) > 1  # the gate is not decided by one repeated frame
    assert r.decisions > 5 * r.frames and len(r.flips) == len(r.near_ties)


def test_gate_of_a_model_against_itself_is_exact(demo: tuple[Path, Path]) -> None:
    """Teacher forcing feeds both runs the same inputs: identical models decide everything alike, to the bit."""
    src, _ = demo
    r = run_gate(src, src, frames=3)
    assert r.passed and r.flips == [] and r.decisions == 3 * 10
    assert r.max_rel_logit_error == 0.0 and r.max_rel_fast_logit_error == 0.0


@pytest.mark.parametrize(("name", "factor"), [
    ("text_model.model.layers.1.attention.wo.weight_scale", 4.0),  # the slow model: main-token logits drift
    ("audio_decoder.layers.1.attention.wo.weight_scale", -1.0),  # the fast transformer: the codebooks' logits drift
])
def test_gate_fails_a_corrupted_block_scale(demo: tuple[Path, Path], tmp_path: Path, name: str,
                                            factor: float) -> None:
    """One 128x128 weight block's scale wrong in the FP8 copy: the gate must notice."""
    from safetensors.torch import load_file, save_file

    src, dst = demo
    bad = tmp_path / "fp8"
    shutil.copytree(dst, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors[name][0, 0] *= factor
    save_file(tensors, str(bad / "model.safetensors"))
    r = run_gate(src, bad)
    assert not r.passed and r.failures
    assert max(r.max_rel_logit_error, r.max_rel_fast_logit_error) >= 0.2


def test_gate_near_tie_rule() -> None:
    """A flip is accepted when bf16's margin is within FP8's noise at that decision, not when one logit is far off."""
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(64, generator=g)
    ref[0], ref[1] = 4.0, 3.98  # bf16 picks 0 by a hair
    fp8 = ref + 0.05 * torch.randn(64, generator=g)
    fp8[0], fp8[1] = 3.97, 4.0
    margin, noise, near_tie = judge(ref, fp8, 0, 1)
    assert near_tie and abs(margin - 0.02) < 1e-6 and 0.05 < noise < 0.1

    ref[1] = 2.0  # a clear decision that FP8 flips by getting one logit badly wrong
    fp8 = ref + 0.05 * torch.randn(64, generator=g)
    fp8[1] = 4.5
    margin, noise, near_tie = judge(ref, fp8, 0, 1)
    assert not near_tie and margin == 2.0 and noise < margin / NOISE_FACTOR
    # a shift common to every logit changes no decision: it is not noise
    assert judge(ref, ref + 1.0, 0, 1)[1] < 1e-6


def test_gate_compares_a_frame_up_to_its_first_flip() -> None:
    """Codebook k+1 is decided after codebook k: after a flip the two models' inputs differ, so the frame stops."""
    g = torch.Generator().manual_seed(1)
    slow, fast = torch.randn(512, generator=g), [torch.randn(64, generator=g) for _ in range(9)]
    main_ids = list(range(446, 510)) + [413]
    ref = FrameTrace(slow, slow[main_ids], fast)
    col = torch.tensor([450, 4] + [int(f.argmax()) for f in fast])
    assert compare_frame(0, ref, ref, col, col, main_ids) == (10, None)
    other = col.clone()
    other[4] = (other[4] + 1) % 64  # codebook 3
    other[6] = (other[6] + 1) % 64  # codebook 5: after the first flip, not compared
    n, flip = compare_frame(2, ref, ref, col, other, main_ids)
    assert n == 4 and flip is not None
    assert (flip.frame, flip.codebook, flip.bf16, flip.fp8) == (2, 3, int(col[4]), int(other[4]))
    assert not flip.near_tie  # the same logits: no noise to explain it
    other = col.clone()
    other[0] = 451
    n, flip = compare_frame(0, ref, ref, col, other, main_ids)
    assert n == 1 and flip is not None and (flip.codebook, flip.bf16, flip.fp8) == (0, 450, 451)


def test_quantize_cli_refuses_bad_input(tmp_path: Path, golden: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["quantize", str(tmp_path / "missing"), str(tmp_path / "out")])
    with pytest.raises(SystemExit):  # the tiny golden model's 64-wide layers do not fit 128x128 blocks
        main(["quantize", str(golden / "tiny-s2"), str(tmp_path / "out2")])
    assert "multiple of the 128x128" in capsys.readouterr().err


@pytest.mark.gpu
def test_gate_on_gpu_kernels(demo: tuple[Path, Path]) -> None:
    r = run_gate(*demo, device="cuda")
    assert r.passed, r.failures
    assert r.columns_fp8_graphs is not None  # the served way too: frame 0 and the decode steps from CUDA graphs


def test_norm_kernels_quantize_for_the_fp8_linears(demo: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP8 block takes its wqkv/MLP inputs quantized by the norm itself (norm_rope.rmsnorm_quant): the same values
    as normalizing in bf16 and letting each FP8 linear quantize."""
    from rtts.model.dual_ar import Block
    from rtts.model.rope import rope_table

    _, dst = demo
    lm = load_model(dst, dtype=torch.bfloat16)
    block = lm.model.layers[0]
    assert block.fp8_inputs
    att = block.attention
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, lm.config.dim, generator=g).bfloat16()
    rows, positions = torch.tensor([0, 1]), torch.tensor([[0, 1, 2], [4, 5, 6]])
    rope = rope_table(8, att.head_dim, lm.config.rope_base)[positions]
    outs = []
    for fused in (True, False):
        monkeypatch.setattr(Block, "fp8_inputs", property(lambda self, f=fused: f))
        kc = torch.zeros(2, 8, att.n_kv, att.head_dim, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        with torch.inference_mode():
            r = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).bfloat16()
            outs.append((*block(x, rope, kc, vc, rows, positions, 8), *block(x, rope, kc, vc, rows, positions, 8, r),
                         kc))
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))


def test_quantize_at_load_equals_the_quantized_checkpoint(demo: tuple[Path, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`rtts serve --fp8` (and --random-preset --fp8, every FP8 benchmark) quantizes the loaded model in place: the
    same FP8 weights and scales as `rtts quantize` then load. The flag reaches the server for real checkpoints too
    (it was read only with --random-preset)."""
    from rtts import runtime
    from rtts.model.quant import quantize_model_
    from rtts.ws import server

    src, dst = demo
    q = load_model(dst, dtype=torch.bfloat16)
    live = load_model(src, dtype=torch.bfloat16)
    quantize_model_(live.model)
    want = {name: mod for name, mod in q.model.named_modules() if isinstance(mod, FP8Linear)}
    got = {name: mod for name, mod in live.model.named_modules() if isinstance(mod, FP8Linear)}
    assert want.keys() == got.keys() and len(want) == 2 * 2 * (2 + 3)  # (slow, fast) x layers x (wqkv, wo, w1-3)
    for name, mod in want.items():
        assert torch.equal(mod.weight.view(torch.uint8), got[name].weight.view(torch.uint8)), name
        assert torch.equal(mod.weight_scale, got[name].weight_scale), name
    quantize_model_(live.model)  # an FP8 model has nothing left to quantize
    assert {n for n, m in live.model.named_modules() if isinstance(m, FP8Linear)} == want.keys()

    configs: list[runtime.ServerConfig] = []
    monkeypatch.setattr(server, "serve", lambda config, rt=None: configs.append(config))
    main(["serve", "--checkpoint", str(src), "--fp8", "--voices-dir", str(src.parent / "voices")])
    assert configs and configs[0].fp8
    rt = runtime.Runtime(runtime.ServerConfig(checkpoint=str(src), fp8=True, warmup=False, cuda_graphs=False))
    assert any(isinstance(m, FP8Linear) for m in rt.loaded.model.modules())
