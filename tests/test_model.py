"""The DualAR engine against the golden reference outputs (tiny-s2, its sharded copy, tiny-s1), float32 on CPU."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rtts.engine import sampling
from rtts.engine.engine import Engine
from rtts.engine.synth import Synthesizer, Turn
from rtts.model.loading import LoadedModel, load_model
from rtts.model.prompt import PromptBuilder, Reference
from rtts.types import FinishReason, SamplingParams

TOL = 1e-5  # the README tolerance for logits / hidden states / embeddings in float32

S2_CASES = ["case0_noref", "case1_ref", "case2_speaker_nonascii", "case3_two_batches"]
S1_CASES = ["case0_noref", "case1_ref", "case2_nonascii", "case3_two_refs"]


def _load(checkpoint: Path) -> LoadedModel:
    return load_model(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def s2(golden: Path) -> LoadedModel:
    return _load(golden / "tiny-s2")


@pytest.fixture(scope="module")
def s2_sharded(tiny_s2_sharded: Path) -> LoadedModel:
    return _load(tiny_s2_sharded)


@pytest.fixture(scope="module")
def s1(golden: Path) -> LoadedModel:
    return _load(golden / "tiny-s1")


def _cases(fixtures: Path) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in json.loads((fixtures / "cases.json").read_text())}


def _references(case: dict[str, Any], case_dir: Path) -> list[Reference]:
    """S2 cases carry prompt_text + ref_codes.npy; S1 cases a list of references + ref_codes[_i].npy."""
    if "references" in case:
        refs = case["references"] or []
        files = [case_dir / "ref_codes.npy"]
        if len(refs) > 1:
            files = [case_dir / f"ref_codes_{i}.npy" for i in range(len(refs))]
        return [Reference(r["text"], torch.from_numpy(np.load(f))) for r, f in zip(refs, files)]
    if case.get("prompt_text"):
        return [Reference(case["prompt_text"], torch.from_numpy(np.load(case_dir / "ref_codes.npy")))]
    return []


def _params(case: dict[str, Any]) -> SamplingParams:
    s = case["sampling"]
    return SamplingParams(
        temperature=s["temperature"],
        top_p=s["top_p"],
        top_k=s.get("top_k", 0),
        repetition_penalty=s.get("repetition_penalty", 1.0),
        max_frames=case["max_new_tokens"],
    )


class Tracer:
    """Collects the engine's intermediate tensors per name."""

    def __init__(self) -> None:
        self.data: dict[str, list[torch.Tensor]] = {}

    def __call__(self, name: str, t: torch.Tensor) -> None:
        self.data.setdefault(name, []).append(t.detach().clone())

    def stacked(self, name: str) -> np.ndarray:
        return torch.cat(self.data[name]).numpy()

    def clear(self) -> None:
        self.data.clear()


def _run(
    lm: LoadedModel,
    refs: list[Reference],
    text: str,
    params: SamplingParams,
    chunk_length: int = 300,
    noise: Callable[..., torch.Tensor] | None = None,
) -> tuple[list[Turn], list[Tracer]]:
    engine = Engine(lm, max_slots=2)
    synth = Synthesizer(engine, slot=1)
    synth.start(refs)
    turns, tracers = [], []
    for batch in synth.builder.split_batches(text, chunk_length):
        tracer = Tracer()
        engine.trace = tracer
        if noise is not None:
            engine.noise = noise
        turns.append(synth.turn(batch, params))
        tracers.append(tracer)
    return turns, tracers


def _maxdiff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max())


# ---------------------------------------------------------------------------------------------------- S2


def test_sharded_loads_bit_identical(s2: LoadedModel, s2_sharded: LoadedModel) -> None:
    a, b = s2.model.state_dict(), s2_sharded.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("case_name", S2_CASES)
def test_s2_prompts(golden: Path, s2: LoadedModel, case_name: str) -> None:
    fx = golden / "tiny-s2" / "fixtures"
    case = _cases(fx)[case_name]
    builder = PromptBuilder(s2.tokenizer, s2.config.num_codebooks, "s2", s2.config.codebook_size)
    refs = _references(case, fx / case_name)
    batches = builder.split_batches(case["text"], case["chunk_length"])
    assert batches == [b["batch_text"] for b in case["batches"]]
    history: list[tuple[str, torch.Tensor | None]] = []
    for i, batch in enumerate(batches):
        prompt = builder.conversation(refs, history + [(batch, None)])
        assert np.array_equal(prompt.numpy(), np.load(fx / case_name / f"b{i}.prompt.npy"))
        history.append((batch, torch.from_numpy(np.load(fx / case_name / f"b{i}.codes.npy"))))


def test_s2_system_prompt_numbers_speakers(s2: LoadedModel) -> None:
    """References carry their speaker: a speaker's several clips share its number (a per-speaker list of
    references); without one, reference i is speaker i (the plain list the fixtures use); a tagged text is kept."""
    builder = PromptBuilder(s2.tokenizer, s2.config.num_codebooks, "s2", s2.config.codebook_size)
    codes = torch.zeros(s2.config.num_codebooks, 2, dtype=torch.int64)
    refs = [Reference("a one", codes, speaker=0), Reference("a two", codes, speaker=0), Reference("b one", codes, 1)]
    plain = [Reference("a one", codes), Reference("a two", codes), Reference("b one", codes)]

    def texts(rs: list[Reference]) -> str:
        row = builder.system(rs)[0]
        return s2.tokenizer.decode([int(t) for t in row if int(t) < s2.tokenizer.semantic_begin_id])

    assert "<|speaker:0|>a one\n<|speaker:0|>a two\n<|speaker:1|>b one" in texts(refs)
    assert "<|speaker:0|>a one\n<|speaker:1|>a two\n<|speaker:2|>b one" in texts(plain)
    assert "<|speaker:5|>tagged" in texts([Reference("<|speaker:5|>tagged", codes, speaker=1)])


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("case_name", S2_CASES)
def test_s2_greedy(golden: Path, s2: LoadedModel, s2_sharded: LoadedModel, case_name: str, layout: str) -> None:
    lm = s2 if layout == "single" else s2_sharded
    fx = golden / "tiny-s2" / "fixtures"
    case = _cases(fx)[case_name]
    turns, tracers = _run(lm, _references(case, fx / case_name), case["text"], _params(case), case["chunk_length"])
    assert len(turns) == len(case["batches"])
    for i, (turn, tracer, meta) in enumerate(zip(turns, tracers, case["batches"])):
        d = fx / case_name
        assert np.array_equal(turn.columns.numpy(), np.load(d / f"b{i}.columns.npy")), f"batch {i} columns"
        assert np.array_equal(turn.codes.numpy(), np.load(d / f"b{i}.codes.npy"))
        assert turn.finish == (FinishReason.STOP if meta["stopped_on_im_end"] else FinishReason.LENGTH)
        assert turn.prompt_positions == meta["prompt_len"]
        n = turn.columns.shape[1]
        # The engine traces one extra (frozen) step after the finish; compare the frames that were generated.
        slow = tracer.stacked("slow_logits")[:n]
        assert _maxdiff(slow, np.load(d / f"b{i}.slow_logits.npy")) <= TOL
        assert _maxdiff(tracer.stacked("hidden_normed")[:n], np.load(d / f"b{i}.fast_hidden_in.npy")) <= TOL
        fast = tracer.stacked("fast_logits").reshape(-1, 9, fast_width(lm))[:n]
        assert _maxdiff(fast, np.load(d / f"b{i}.fast_logits.npy")) <= TOL


def fast_width(lm: LoadedModel) -> int:
    return lm.config.codebook_size


def test_s2_prefill_intermediates(golden: Path, s2: LoadedModel) -> None:
    fx = golden / "tiny-s2" / "fixtures"
    case = _cases(fx)["case1_ref"]
    builder = PromptBuilder(s2.tokenizer, s2.config.num_codebooks, "s2", s2.config.codebook_size)
    prompt = builder.conversation(_references(case, fx / "case1_ref"), [(case["text"], None)])
    pre = fx / "prefill_case1"
    m = s2.model
    x = m.embed(prompt[None])
    assert _maxdiff(x[0].numpy(), np.load(pre / "embeddings.npy")) <= TOL

    # Layer by layer on a fresh one-slot cache.
    engine = Engine(s2, max_slots=1, max_ctx=512)
    T = prompt.shape[1]
    positions = torch.arange(T)[None]
    slots = torch.tensor([0])
    outs = []
    h, r = x, None
    with torch.inference_mode():
        for i, layer in enumerate(m.layers):
            # a block returns its stream and its MLP output; the next block adds them (in its first norm kernel)
            h, r = layer(h, engine.rope[positions], engine.kv.k[i], engine.kv.v[i], slots, positions, T, residual=r)
            outs.append((h + r)[0])
        assert _maxdiff(torch.stack(outs).numpy(), np.load(pre / "layer_outputs.npy")) <= TOL
        normed, fast_in = m.slow_head((h + r)[:, -1])
        assert _maxdiff((normed @ m.head_weight().T)[0].numpy(), np.load(pre / "logits_last.npy")) <= TOL
        assert _maxdiff(fast_in[0].numpy(), np.load(pre / "hidden_last.npy")) <= TOL

    tracer = Tracer()
    engine = Engine(s2, max_slots=1)
    engine.trace = tracer
    engine.reset_slot(0)
    engine.set_params(0, SamplingParams(temperature=1.0, top_p=0.9, top_k=1))
    engine.prefill(0, prompt, sample=True)
    assert _maxdiff(tracer.stacked("fast_logits"), np.load(pre / "fast_logits_frame0.npy")) <= TOL


def _s2_noise(fx: Path) -> Callable[..., torch.Tensor]:
    """Replays the recorded uniform noise u as q = -log(u), indexed by frame (= RNG counter of a fresh slot)."""
    main = torch.from_numpy(np.load(fx / "sampled_case1" / "noise_main.npy"))  # [N, 2, V]
    fast = torch.from_numpy(np.load(fx / "sampled_case1" / "noise_fast.npy"))  # [N, 9, cb]

    def noise(seeds: torch.Tensor, counters: torch.Tensor, draw: int, ids: torch.Tensor) -> torch.Tensor:
        f = counters.clamp(max=main.shape[0] - 1)  # the frozen step after the last frame reuses the last noise
        u = main[f, draw] if draw < 2 else fast[f, draw - 2]
        return -torch.log(u[:, ids])

    return noise


def test_s2_sampled_replay(golden: Path, s2: LoadedModel) -> None:
    fx = golden / "tiny-s2" / "fixtures"
    case = _cases(fx)["case1_ref"]
    frames = json.loads((fx / "sampled_case1" / "frames.json").read_text())
    s = frames["sampling"]
    params = SamplingParams(temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                            max_frames=frames["n_frames"])
    turns, _ = _run(s2, _references(case, fx / "case1_ref"), case["text"], params, noise=_s2_noise(fx))
    cols = turns[0].columns.numpy()
    expected = np.load(fx / "sampled_case1" / "columns.npy")
    assert np.array_equal(cols, expected)
    # RAS fired exactly where the reference's did (the final token differs from the normal draw there).
    for fr in frames["frames"]:
        assert cols[0, fr["frame"]] == fr["token_final"]


@pytest.mark.parametrize("variant", ["f32", "f32_logits_bf16_params", "bf16"])
def test_s2_sampling_math(golden: Path, variant: str) -> None:
    sm = golden / "tiny-s2" / "fixtures" / "sampling_math"
    params = json.loads((sm / "params.json").read_text())["param_sets"]
    logits = torch.from_numpy(np.load(sm / "logits.npy"))
    q = -torch.log(torch.from_numpy(np.load(sm / "noise_u.npy")))
    probs_ref = np.load(sm / f"probs_{variant}.npy")
    draws_ref = np.load(sm / f"draw_{variant}.npy")
    for i, p in enumerate(params):
        bf16_params = variant != "f32"
        t = p["temperature_bf16"] if bf16_params else p["temperature"]
        tp = p["top_p_bf16"] if bf16_params else p["top_p"]
        x = logits.to(torch.bfloat16) if variant == "bf16" else logits
        B = x.shape[0]
        probs = sampling.filtered_probs(x, torch.full((B,), t), torch.full((B,), tp), torch.full((B,), p["top_k"]))
        got = probs.float().numpy()
        if variant == "bf16":
            assert np.abs(got - probs_ref[i]).max() <= 1e-2 * max(1.0, float(np.abs(probs_ref[i]).max()))
        else:
            assert _maxdiff(got, probs_ref[i]) <= 1e-6
            assert np.array_equal(sampling.race(probs, q).numpy(), draws_ref[i])


# ---------------------------------------------------------------------------------------------------- S1


@pytest.mark.parametrize("case_name", S1_CASES)
def test_s1_prompt_and_greedy(golden: Path, s1: LoadedModel, case_name: str) -> None:
    fx = golden / "tiny-s1" / "fixtures"
    case = _cases(fx)[case_name]
    d = fx / case_name
    refs = _references(case, d)
    builder = PromptBuilder(s1.tokenizer, s1.config.num_codebooks, "s1", s1.config.codebook_size)
    assert builder.split_batches(case["text"], 100) == [case["text"]]  # S1 never splits
    prompt = builder.conversation(refs, [(case["text"], None)])
    assert np.array_equal(prompt.numpy(), np.load(d / "b0.prompt.npy"))

    turns, tracers = _run(s1, refs, case["text"], _params(case))
    turn, tracer = turns[0], tracers[0]
    assert np.array_equal(turn.columns.numpy(), np.load(d / "b0.columns.npy"))
    assert np.array_equal(turn.codes.numpy(), np.load(d / "b0.codes.npy"))
    meta = case["batches"][0]
    assert turn.finish == (FinishReason.STOP if meta["stopped_on_im_end"] else FinishReason.LENGTH)
    n = turn.columns.shape[1]
    assert _maxdiff(tracer.stacked("slow_logits")[:n], np.load(d / "b0.slow_logits.npy")) <= TOL
    assert _maxdiff(tracer.stacked("fast_in")[:n], np.load(d / "b0.fast_hidden_in.npy")) <= TOL
    fast = tracer.stacked("fast_logits").reshape(-1, 9, s1.config.codebook_size)[:n]
    assert _maxdiff(fast, np.load(d / "b0.fast_logits.npy")) <= TOL


def test_s1_prefill_intermediates(golden: Path, s1: LoadedModel) -> None:
    fx = golden / "tiny-s1" / "fixtures"
    case = _cases(fx)["case1_ref"]
    builder = PromptBuilder(s1.tokenizer, s1.config.num_codebooks, "s1", s1.config.codebook_size)
    prompt = builder.conversation(_references(case, fx / "case1_ref"), [(case["text"], None)])
    pre = fx / "prefill_case1"
    tracer = Tracer()
    engine = Engine(s1, max_slots=1)
    engine.trace = tracer
    engine.reset_slot(0)
    engine.set_params(0, _params(case))
    engine.prefill(0, prompt, sample=True)
    assert _maxdiff(tracer.stacked("embeddings"), np.load(pre / "embeddings.npy")) <= TOL
    assert _maxdiff(tracer.stacked("slow_logits")[0], np.load(pre / "logits_last.npy")) <= TOL
    # S1 feeds the fast model the hidden BEFORE the final norm.
    assert _maxdiff(tracer.stacked("fast_in")[0], np.load(pre / "hidden_last.npy")) <= TOL
    assert _maxdiff(tracer.stacked("hidden_normed")[0], np.load(pre / "hidden_last_normed.npy")) <= TOL
    assert _maxdiff(tracer.stacked("fast_logits"), np.load(pre / "fast_logits_frame0.npy")) <= TOL


def _s1_noise(fx: Path) -> Callable[..., torch.Tensor]:
    main = torch.from_numpy(np.load(fx / "sampled_case1" / "noise_main.npy"))  # [N, V] Exp(1)
    fast = torch.from_numpy(np.load(fx / "sampled_case1" / "noise_fast.npy"))  # [N, 9, cb]

    def noise(seeds: torch.Tensor, counters: torch.Tensor, draw: int, ids: torch.Tensor) -> torch.Tensor:
        f = counters.clamp(max=main.shape[0] - 1)
        q = main[f] if draw == 0 else fast[f, draw - 2]
        return q[:, ids]

    return noise


@pytest.mark.parametrize("run", ["penalty_case1", "sampled_case1"])
def test_s1_penalty_runs(golden: Path, s1: LoadedModel, run: str) -> None:
    fx = golden / "tiny-s1" / "fixtures"
    case = _cases(fx)["case1_ref"]
    frames = json.loads((fx / run / "frames.json").read_text())
    s = frames["sampling"]
    params = SamplingParams(temperature=s["temperature"], top_p=s["top_p"], top_k=0,
                            repetition_penalty=s["repetition_penalty"], max_frames=frames["n_frames"])
    noise = _s1_noise(fx) if run == "sampled_case1" else None
    turns, tracers = _run(s1, _references(case, fx / "case1_ref"), case["text"], params, noise=noise)
    turn, tracer = turns[0], tracers[0]
    d = fx / run
    assert np.array_equal(turn.columns.numpy(), np.load(d / "columns.npy"))
    assert np.array_equal(turn.codes.numpy(), np.load(d / "codes.npy"))
    n = turn.columns.shape[1]
    # Frame 0 has no penalty: its penalized logits equal the raw ones; the engine traces penalized logits of
    # decode frames only.
    pen_ref = np.load(d / "slow_logits_penalized.npy")
    assert _maxdiff(tracer.stacked("slow_logits")[0], pen_ref[0]) <= TOL
    assert _maxdiff(tracer.stacked("slow_logits_penalized")[: n - 1], pen_ref[1:]) <= TOL
    fast_pen_ref = np.load(d / "fast_logits_penalized.npy")
    got = tracer.stacked("fast_logits_penalized").reshape(-1, 9, fast_pen_ref.shape[-1])[: n - 1]
    assert _maxdiff(got, fast_pen_ref[1:]) <= TOL


@pytest.mark.parametrize("variant", ["f32", "bf16"])
def test_s1_sampling_math(golden: Path, variant: str) -> None:
    sm = golden / "tiny-s1" / "fixtures" / "sampling_math"
    params = json.loads((sm / "params.json").read_text())["param_sets"]
    logits = torch.from_numpy(np.load(sm / "logits.npy"))
    windows = torch.from_numpy(np.load(sm / "windows.npy"))
    q = torch.from_numpy(np.load(sm / "noise_q.npy"))
    pen_ref, probs_ref = np.load(sm / f"penalized_{variant}.npy"), np.load(sm / f"probs_{variant}.npy")
    draws_ref = np.load(sm / f"draw_{variant}.npy")
    x = logits.to(torch.bfloat16) if variant == "bf16" else logits
    B, V = x.shape
    for i, p in enumerate(params):
        pen = sampling.repetition_penalty(x, windows, torch.full((B,), p["repetition_penalty"]))
        probs = sampling.filtered_probs(pen, torch.full((B,), p["temperature"]), torch.full((B,), p["top_p"]),
                                        torch.full((B,), V + 1))
        if variant == "f32":
            assert _maxdiff(pen.numpy(), pen_ref[i]) <= TOL
            assert _maxdiff(probs.numpy(), probs_ref[i]) <= 1e-6
            assert np.array_equal(sampling.race(probs, q).numpy(), draws_ref[i])
        else:
            scale = float(np.abs(pen_ref[i][np.isfinite(pen_ref[i])]).max())
            assert _maxdiff(pen.float().numpy(), pen_ref[i]) <= 1e-2 * scale
            assert np.abs(probs.float().numpy() - probs_ref[i]).max() <= 1e-2


# ---------------------------------------------------------------------------------------------------- batching


def test_batched_decode_matches_single(golden: Path, s2: LoadedModel) -> None:
    """Two streams in one decode batch, joined at different steps, give each stream's solo greedy columns."""
    fx = golden / "tiny-s2" / "fixtures"
    cases = _cases(fx)
    engine = Engine(s2, max_slots=3)
    builder = PromptBuilder(s2.tokenizer, s2.config.num_codebooks, "s2", s2.config.codebook_size)
    plan = {2: "case0_noref", 0: "case1_ref"}  # slot -> case
    expected = {s: np.load(fx / c / "b0.columns.npy") for s, c in plan.items()}
    got: dict[int, list[torch.Tensor]] = {s: [] for s in plan}
    live: list[int] = []
    for step in range(40):
        if step in (0, 5):  # second stream joins mid-way
            slot = 2 if step == 0 else 0
            case = cases[plan[slot]]
            engine.reset_slot(slot)
            engine.set_params(slot, _params(case))
            engine.prefill(slot, builder.system(_references(case, fx / plan[slot])))
            got[slot].append(engine.prefill(slot, builder.turn(case["text"]), sample=True))
            live.append(slot)
        if not live:
            break
        cols, fin = engine.decode(live)
        for row, slot in enumerate(list(live)):
            got[slot].append(cols[row])
            if fin[row] != FinishReason.RUNNING:
                live.remove(slot)
    for slot, exp in expected.items():
        assert np.array_equal(torch.stack(got[slot], 1).numpy(), exp), plan[slot]
