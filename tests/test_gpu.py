"""GPU-only checks (marked `gpu`, deselected without CUDA): the scheduler with CUDA graphs on the golden tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from rtts.engine.engine import Engine, PrefillItem
from rtts.model.codec import load_codec
from rtts.model.loading import load_model
from rtts.model.prompt import Reference
from rtts.pingpong import AudioChunk, Scheduler, SchedulerConfig, TurnEnd
from rtts.types import FinishReason, SamplingParams

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=1.0, top_p=0.9, top_k=1, max_frames=24)


@pytest.mark.parametrize("more_graphs,tf32", [(False, False), (True, False), (True, True)])
def test_graph_scheduler_matches_golden(golden: Path, more_graphs: bool, tf32: bool) -> None:
    """more_graphs: also the codec's and the turn prefills' graphs. tf32: the codec decodes with TF32 tensor cores
    (the server's default): the codes are the same, the audio a little further from the fixture."""
    ckpt = golden / "tiny-s2"
    fx = ckpt / "fixtures"
    lm = load_model(ckpt, device="cuda", dtype=torch.float32)
    codec = load_codec(ckpt, device="cuda", dtype=torch.float32)
    engine = Engine(lm, max_slots=6, max_ctx=1024)
    cases = {c["name"]: c for c in json.loads((fx / "cases.json").read_text())}
    config = SchedulerConfig(cuda_graphs=True, codec_graphs=more_graphs, prefill_graphs=more_graphs, codec_tf32=tf32)
    with Scheduler(engine, codec, config) as sch:
        assert engine.decode_runner is not None and engine.decode_runner.graphs
        assert engine.frame_zero_runner is not None and engine.frame_zero_runner.graphs
        assert (sch.codec_worker.runner is not None) == (engine.prefill_runner is not None) == more_graphs
        graphed = (engine.prefill_runner, sch.codec_worker.runner)
        runs = []
        for name in ("case0_noref", "case1_ref", "case2_speaker_nonascii", "case3_two_batches"):
            c = cases[name]
            refs = []
            if c["prompt_text"]:
                refs = [Reference(c["prompt_text"], torch.from_numpy(np.load(fx / name / "ref_codes.npy")))]
            h = sch.open(refs)
            runs.append((name, h, [h.speak(b["batch_text"], GREEDY, latency="low") for b in c["batches"]]))
        for name, h, obs in runs:
            for i, ob in enumerate(obs):
                pcm, end = [], None
                for item in ob:
                    if isinstance(item, AudioChunk):
                        pcm.append(item.pcm)
                    else:
                        end = item
                assert isinstance(end, TurnEnd) and end.ok, (name, end)
                assert np.array_equal(end.codes, np.load(fx / name / f"b{i}.codes.npy")), (name, i)
                if i == 0:
                    ref = np.load(fx / name / "b0.codes_decoded.wav.npy")
                    got = np.concatenate(pcm)
                    if tf32:
                        snr = 10 * np.log10(np.sum(ref.astype(np.float64) ** 2) / np.sum((got - ref) ** 2.0))
                        assert snr > 40 and np.abs(got - ref).max() < 2e-2, (name, snr)
                    else:
                        assert np.abs(got - ref).max() < 1e-3, name
            h.close()
        # With the extra graphs on, the turns really went through them (not an eager fallback).
        assert all(r is not None and r.replays > 0 for r in graphed) == more_graphs


def test_codec_graphs_equal_the_eager_stream(golden: Path) -> None:
    """CodecGraphRunner (padded buckets on the scratch slot, frame counts split 8/4/2/1) against decode_stream on a
    second state fed the same calls: the same audio and the same per-slot state, within float rounding."""
    from rtts.engine.graphs.codec import CodecGraphRunner

    codec = load_codec(golden / "tiny-s2", device="cuda", dtype=torch.float32)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    # true float32, as CodecWorker(tf32=False) sets it: TF32 convolutions differ by chunk length
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    graphed, eager = codec.new_stream_state(8), codec.new_stream_state(8)
    runner = CodecGraphRunner(codec, graphed, max_batch=7, scratch_slot=7)
    with torch.inference_mode():
        runner.capture()
        assert runner.graphs and runner.buckets == [1, 2, 4, 7]
        g = torch.Generator().manual_seed(0)
        # [0, 2, 3, 5, 6] pads two rows onto the scratch slot (bucket 7)
        for slots, n in (([0], 1), ([0, 3, 5], 4), ([1], 11), ([0, 1, 2, 3, 4, 5], 8), ([0, 2, 3, 5, 6], 3),
                         ([2, 4], 3), ([5], 2)):
            codes = torch.randint(0, codec.config.codebook_size, (len(slots), codec.config.num_codebooks, n),
                                  generator=g).cuda()
            s = torch.tensor(slots, device="cuda")
            got = runner.decode(codes, s)
            want = codec.decode_stream(codes, eager, s)
            assert got.shape == want.shape
            assert (got - want).abs().max().item() < 1e-3, (slots, n)
        torch.cuda.synchronize()
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    assert runner.replays >= 10
    for a, b in zip((*graphed.tails, graphed.kv), (*eager.tails, eager.kv)):
        assert (a[:7] - b[:7]).abs().max().item() < 1e-3
    assert torch.equal(graphed.pos[:7], eager.pos[:7])


def test_graph_replay_equals_eager(golden: Path) -> None:
    """Replaying a captured bucket gives the eager step's columns for the same slot state; frame 0 of a turn,
    sampled by the prefill from its own graphs (Engine.frame_zero_runner), equals the eager one, for one turn and for
    a batch of three padded to a bucket of four."""
    lm = load_model(golden / "tiny-s2", device="cuda", dtype=torch.float32)
    outs, zeros = [], []
    for graphs in (False, True):
        engine = Engine(lm, max_slots=8, max_ctx=256)
        if graphs:
            engine.capture_graphs(prefill=False)
        assert (engine.decode_runner is not None) == (engine.frame_zero_runner is not None) == graphs
        slots = [1, 3, 4]
        frame0 = []
        for s in slots:
            engine.reset_slot(s)
            engine.set_params(s, SamplingParams(seed=s, top_k=1 if s == 1 else 30, max_frames=100))
            frame0.append(engine.prefill(s, torch.tensor([[412, 82, 88, 83 + s]] + [[0] * 4] * 10), sample=True))
        batch = [PrefillItem(s, torch.tensor([[412, 90 + s]] + [[0] * 2] * 10), sample=True) for s in (5, 6, 7)]
        for it in batch:
            engine.reset_slot(it.slot)
            engine.set_params(it.slot, SamplingParams(seed=it.slot, temperature=0.9, max_frames=100))
        frame0.append(engine.prefill_batch(batch))
        zeros.append(torch.cat([f.cpu().reshape(-1, 11) for f in frame0 if f is not None]))
        assert engine.state.frame[[1, 3, 4, 5, 6, 7]].tolist() == [1] * 6  # each committed once, padding never
        assert int(engine.state.finish[engine.scratch_slot]) == FinishReason.CANCELLED
        cols = []
        for _ in range(5):
            c, _f = engine.decode_batch(slots, max(engine.host_pos[s] for s in slots) + 8)
            cols.append(c[: len(slots)].cpu())
        outs.append(torch.stack(cols))
    assert zeros[0].shape == (6, 11)
    assert torch.equal(zeros[0], zeros[1])
    assert torch.equal(outs[0], outs[1])
    few = Engine(lm, max_slots=3, max_ctx=64)  # fewer slots than prefill rows: no bucket wider than the slots
    few.capture_graphs(prefill=False)
    assert few.frame_zero_runner is not None and few.frame_zero_runner.buckets == [1, 2, 3]


def test_prefill_graphs_equal_the_eager_forward(golden: Path) -> None:
    """PrefillRunner's replay (padded to its bucket, whole-cache attention) against the exact-size eager forward on
    the same cache contents: the same hidden states for the real rows and the same K/V in the real slots."""
    lm = load_model(golden / "tiny-s2", device="cuda", dtype=torch.float32)
    eng = Engine(lm, max_slots=4, max_ctx=256)
    g = torch.Generator().manual_seed(4)
    for slot, n in ((1, 21), (2, 7)):
        eng.prefill_batch([PrefillItem(slot, torch.randint(0, 100, (eng.rows, n), generator=g))])
    eng.capture_graphs()
    runner = eng.prefill_runner
    assert runner is not None and runner.bucket(3, 13, 40) is not None and runner.bucket(3, 257, 257) is None
    lengths = {1: 13, 2: 5, 0: 9}
    items = [PrefillItem(slot, torch.randint(0, 100, (eng.rows, t), generator=g)) for slot, t in lengths.items()]
    kv_len = max(eng.host_pos[s] + t for s, t in lengths.items())
    key = runner.bucket(3, 13, kv_len)
    assert key is not None
    cols, positions, slots = eng.pack_prefill(items, 3, 13)
    with torch.inference_mode():
        k0, v0 = eng.kv.k.clone(), eng.kv.v.clone()
        want = eng.prefill_forward(cols.cuda(), positions.cuda(), slots.cuda(), kv_len)
        kw, vw = eng.kv.k.clone(), eng.kv.v.clone()
        eng.kv.k.copy_(k0)
        eng.kv.v.copy_(v0)
        got = runner(*eng.pack_prefill(items, *key[:2]), key)
        torch.cuda.synchronize()
    assert runner.replays == 1
    # Slot 3 took no part: its cache rows are as they were (the padded item wrote the scratch slot's).
    assert torch.equal(eng.kv.k[:, 3], k0[:, 3]) and torch.equal(eng.kv.v[:, 3], v0[:, 3])
    for i, (slot, t) in enumerate(lengths.items()):
        assert (got[i, :t] - want[i, :t]).abs().max().item() < 1e-3, slot
        end = eng.host_pos[slot] + t
        assert (eng.kv.k[:, slot, :end] - kw[:, slot, :end]).abs().max().item() < 1e-3
        assert (eng.kv.v[:, slot, :end] - vw[:, slot, :end]).abs().max().item() < 1e-3


@pytest.mark.parametrize("prefill_graphs", [False, True])
def test_fp8_scheduler_with_concurrent_prefill_and_decode_graphs(tmp_path: Path, prefill_graphs: bool) -> None:
    """FP8 streams whose turns keep starting while others decode: the prefill thread replays its frame-0 graphs while
    the decode thread replays its steps, each family on its own FP8 GEMM scratch (kernels.graph_scratch). Sharing
    one scratch mixed the two threads' split-tile counters and hung the GPU (H200, af3301e); here every turn must
    end normally within the timeout."""
    from rtts.bench.gate import make_demo

    _, fp8_dir = make_demo(tmp_path)
    lm = load_model(fp8_dir, device="cuda", dtype=torch.bfloat16)
    codec = load_codec(fp8_dir, device="cuda", dtype=torch.float32)
    engine = Engine(lm, max_slots=6, max_ctx=512)
    params = SamplingParams(temperature=0.8, top_p=0.8, top_k=30, max_frames=12)
    with Scheduler(engine, codec, SchedulerConfig(cuda_graphs=True, prefill_graphs=prefill_graphs)) as sch:
        assert engine.frame_zero_runner is not None
        handles = [sch.open([]) for _ in range(6)]
        ended = 0
        outboxes = [h.speak(f"Turn zero of stream {i}.", params) for i, h in enumerate(handles)]
        for turn in range(4):  # each stream's next turn is spoken as soon as its last ends: prefills meet decodes
            for i, h in enumerate(handles):
                while True:
                    item = outboxes[i].get(timeout=60)
                    if isinstance(item, TurnEnd):
                        assert item.ok, (i, turn, item)
                        ended += 1
                        break
                if turn < 3:
                    outboxes[i] = h.speak(f"Turn {turn + 1} of stream {i}.", params)
        assert ended == 24
        for h in handles:
            h.close()
