"""FP8 correctness gate: does the FP8 serving path compute the bf16 model within FP8's precision, and decide as it does
wherever the decision is not a near-tie?

`python -m rtts.bench gate --checkpoint BF16_DIR --fp8 FP8_DIR [--device cuda]` (or `--make-demo OUT` first, which
writes a small S2-format model whose logits are far from flat, plus its FP8 copy).

The bf16 model greedy-decodes `--frames` frames of a fixed sentence; the FP8 model decodes alongside, teacher-forced:
after each frame it takes the reference's slot state (the next input column, RAS window, S1 penalty ring, finish), so
both models see the same inputs at every frame and their logits compare frame by frame. (Free-running decodes do not:
one near-tie decided the other way changes every later input.)

Within a frame codebook k+1 is decided after codebook k, so a frame's decisions (main token, then codebooks 1..9) are
compared in order up to the first mismatch, after which the inputs differ. A mismatch is accepted only as a near-tie:
bf16's margin between its choice and FP8's is at most NOISE_FACTOR times FP8's error on a logit difference at that
decision (`judge`). The gate passes when every mismatch is such a near-tie, they are at most `--max-flip-share` of the
decisions compared, and the relative logit error (`rel_error`) of the main token and of the fast codebooks (where the
inputs were identical) stays under `--bound`. On CUDA the FP8 model also decodes as the server does, frame 0 and the
steps replayed from CUDA graphs, forced the same way: the same math on the same inputs, so its frames must equal the
eager FP8 frames token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from rtts.engine.engine import Engine, SlotState
from rtts.model.codec import random_codec_state_dict
from rtts.model.loading import LoadedModel, load_model
from rtts.model.prompt import PromptBuilder
from rtts.tools.quantize_checkpoint import quantize_checkpoint
from rtts.tools.random_checkpoint import codec_config_for, parameter_shapes, to_release_key, write_tokenizer
from rtts.tools.safetensors_writer import write_safetensors
from rtts.types import SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog."
# A flip is a near-tie when bf16's margin is within this many standard deviations of FP8's error on it: 3, so FP8 noise
# alone fails a flip about once in a thousand. Not a multiple of the largest logit error at the decision: an argmax flip
# always has a margin under twice that (ref[a] - ref[b] <= (ref[a] - fp8[a]) + (fp8[b] - ref[b])), so it accepts all.
NOISE_FACTOR = 3.0

GATE_CONFIG = {
    "model_type": "fish_qwen3_omni", "dtype": "bfloat16", "eos_token_id": 413, "pad_token_id": 437,
    "audio_pad_token_id": 445, "semantic_start_token_id": 446, "semantic_end_token_id": 509,
    "text_config": {"vocab_size": 512, "n_layer": 2, "n_head": 4, "n_local_heads": 2, "head_dim": 128, "dim": 256,
                    "intermediate_size": 512, "rope_base": 1000000.0, "norm_eps": 1e-06, "max_seq_len": 4096,
                    "tie_word_embeddings": True, "attention_qk_norm": True},
    "audio_decoder_config": {"vocab_size": 64, "n_layer": 2, "n_head": 4, "n_local_heads": 2, "head_dim": 128,
                             "dim": 256, "intermediate_size": 512, "num_codebooks": 10},
}


def make_demo(out: str | Path, seed: int = 0, head_gain: float = 2.0, branch_gain: float = 0.5) -> tuple[Path, Path]:
    """A small S2-format model (all dims multiples of 128) whose greedy decisions are mostly not on a knife's edge,
    and its `rtts quantize` copy. Returns (bf16 dir, fp8 dir).

    With random weights every logit is within a percent or two of the next, closer than FP8 rounding, so any FP8
    path would "fail". Here the residual branches (attention `wo`, MLP `w2`) are scaled by `branch_gain`, so the
    hidden state is dominated by its (exact, bf16) input embedding plus a smaller FP8-computed correction, and the
    tied head is scaled by `head_gain`: most decisions have clear margins while every FP8 GEMM still contributes.
    A few percent remain near-ties that FP8 decides the other way (a smaller branch gain makes the greedy decode
    repeat one frame, and the head gain scales logits and FP8 error alike): the gate accepts those as near-ties."""
    from rtts.model.config import DualARConfig

    src = Path(out) / "bf16"
    src.mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text(json.dumps(GATE_CONFIG, indent=2))
    config = DualARConfig.from_dict(GATE_CONFIG)
    write_tokenizer(src, config)
    shapes = parameter_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    made = {}
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.05 * torch.randn(shape, generator=gen)
        else:
            t = torch.randn(shape, generator=gen) * (1.0 / shape[-1] ** 0.5)
            if name in ("embeddings.weight", "fast_output.weight", "fast_embeddings.weight",
                        "codebook_embeddings.weight"):
                t = t * head_gain
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                t = t * branch_gain
        made[to_release_key(name, "s2")] = t.to(torch.bfloat16)
    # The fast head shares the fast input embedding's directions, as the slow head is tied to its embedding: each
    # decision is then a clear best match rather than a near-tie between random directions.
    made["audio_decoder.output.weight"] = made["audio_decoder.embeddings.weight"].clone()
    write_safetensors(src / "model.safetensors", [(k, tuple(v.shape), v.dtype) for k, v in made.items()],
                      lambda k: made[k])
    torch.save(random_codec_state_dict(codec_config_for("tiny", src), seed=seed), src / "codec.pth")
    dst = quantize_checkpoint(src, Path(out) / "fp8", progress=False)
    return src, dst


@dataclass(frozen=True)
class Flip:
    """A decision FP8 made differently from bf16 on identical inputs."""

    frame: int
    codebook: int  # 0: the main token (choices are token ids), k >= 1: fast codebook k (choices are codes)
    bf16: int
    fp8: int
    margin: float  # bf16 logit of its choice minus its logit of the FP8 choice
    noise: float  # FP8's RMS error on a difference of two of the decision's logits
    near_tie: bool  # margin <= NOISE_FACTOR * noise: accepted


def judge(ref: torch.Tensor, fp8: torch.Tensor, ref_choice: int, fp8_choice: int) -> tuple[float, float, bool]:
    """The rule for one mismatch, from the two models' logits over the decision's candidates (ref, fp8 [n]; the
    choices index into them) -> (margin, noise, near_tie). The noise is measured at this decision: sqrt(2) x the
    standard deviation of fp8 - ref, the RMS error on the difference of two independent logits (a shift common to all
    logits changes no decision, hence centred)."""
    margin = float(ref[ref_choice] - ref[fp8_choice])
    noise = float((fp8.float() - ref.float()).std(correction=0)) * 2**0.5
    return margin, noise, margin <= NOISE_FACTOR * noise


_TRACED = frozenset({"slow_logits", "slow_logits_penalized", "fast_logits", "fast_logits_penalized"})


@dataclass
class FrameTrace:
    """One frame's decision logits (float32, CPU): the main token's over its candidates and each fast codebook's."""

    slow: torch.Tensor  # [vocab] the slow head's logits (the relative-error measure)
    main: torch.Tensor  # [n_main] what the main token was chosen from (S1: after the repetition penalty)
    fast: list[torch.Tensor] = field(default_factory=list)  # [fast_vocab] per codebook 1..9


class GreedyRun:
    """One model decoding the demo sentence greedily, one frame per `next()`, its decision logits traced (or, with
    graphs=True on CUDA, decoded as the server decodes: frame 0 and the steps replayed from CUDA graphs, untraced)."""

    def __init__(self, lm: LoadedModel, frames: int, graphs: bool = False) -> None:
        self.engine = e = Engine(lm, max_slots=1, max_ctx=512)
        self.graphs = graphs
        self.frames: list[FrameTrace] = []
        self.columns: list[torch.Tensor] = []  # [rows] per frame (CPU)
        self._main_ids = e.main_ids.cpu()
        if graphs:
            e.capture_graphs(prefill=False)
        else:
            e.trace = self._trace
        e.reset_slot(0)
        e.set_params(0, SamplingParams(temperature=1.0, top_p=1.0, top_k=1, max_frames=frames + 1))
        self._builder = PromptBuilder(lm.tokenizer, lm.config.num_codebooks, lm.config.format, lm.config.codebook_size)
        e.prefill(0, self._builder.system())

    def _trace(self, name: str, t: torch.Tensor) -> None:
        if name not in _TRACED:  # (each copy to the host is a device sync)
            return
        v = t[0].float().cpu()
        if name == "slow_logits":
            self.frames.append(FrameTrace(v, v[self._main_ids]))
        elif name == "slow_logits_penalized":
            self.frames[-1].main = v
        elif name == "fast_logits":
            self.frames[-1].fast.append(v[: self.engine.fast_vocab])
        elif name == "fast_logits_penalized":
            self.frames[-1].fast[-1] = v

    def next(self) -> torch.Tensor:
        """Sample the next frame -> its column [rows] (CPU)."""
        e = self.engine
        if not self.columns:
            col = e.prefill(0, self._builder.turn(TEXT), sample=True)
            assert col is not None
        elif not self.graphs:
            col = e.decode([0])[0][0]
        else:  # the decode thread's call: kv_len bounds the slot's context plus the position fed now
            col = e.decode_batch([0], e.host_pos[0] + 1)[0][0]
            e.host_pos[0] += 1
        self.columns.append(col.cpu().clone())
        return self.columns[-1]

    def follow(self, ref: GreedyRun) -> None:
        """Teacher forcing: take the reference's slot state, so the next frame is fed the reference's column. Every
        field is either the same in both runs by construction (positions, counters, parameters) or made of the
        reference's samples (last_col, RAS window, S1 ring, finish); the KV caches stay this model's own. In place:
        captured graphs read these tensors."""
        for f in fields(SlotState):
            getattr(self.engine.state, f.name).copy_(getattr(ref.engine.state, f.name))


@dataclass
class GateResult:
    frames: int
    decisions: int  # decisions compared: per frame the main token and codebooks 1..9, up to the first mismatch
    flips: list[Flip]  # every mismatch; the gate accepts near-ties only, at most max_flip_share of the decisions
    max_rel_logit_error: float  # max |bf16 - fp8| over every frame's slow-head logits / their max |bf16| (rel_error)
    max_rel_fast_logit_error: float  # the same over the fast codebooks' logits compared (identical inputs)
    failures: list[str]  # why the gate failed; empty when it passed
    passed: bool
    columns_bf16: list[list[int]]  # [frame][row] the reference's free-running greedy decode
    columns_fp8: list[list[int]]  # [frame][row] FP8's choices with the reference's inputs
    # CUDA only: the FP8 model's forced frames replayed from the serving path's CUDA graphs (None elsewhere); the gate
    # then also needs them token-identical to the eager FP8 frames
    columns_fp8_graphs: list[list[int]] | None = None

    @property
    def near_ties(self) -> list[Flip]:
        """The flips accepted."""
        return [f for f in self.flips if f.near_tie]


def rel_error(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The largest logit error relative to the largest logit, over one head's (bf16, fp8) logit pairs: relative to
    each pair's own largest logit, a decision whose logits are all small would weigh its rounding most."""
    if not pairs:
        return 0.0
    return max(float((a - b).abs().max()) for a, b in pairs) / max(float(a.abs().max()) for a, _ in pairs)


def compare_frame(index: int, ref: FrameTrace, fp8: FrameTrace, ref_col: torch.Tensor, fp8_col: torch.Tensor,
                  main_ids: list[int]) -> tuple[int, Flip | None]:
    """Compare one frame's decisions in order up to the first mismatch -> (decisions compared, that mismatch).
    Column rows: [main token, c0 (the main token's code), c1..c9]."""
    a, b = int(ref_col[0]), int(fp8_col[0])
    if a != b:
        return 1, Flip(index, 0, a, b, *judge(ref.main, fp8.main, main_ids.index(a), main_ids.index(b)))
    for k, (lr, lq) in enumerate(zip(ref.fast, fp8.fast), start=1):
        a, b = int(ref_col[k + 1]), int(fp8_col[k + 1])
        if a != b:
            return k + 1, Flip(index, k, a, b, *judge(lr, lq, a, b))
    return 1 + len(ref.fast), None


def run_gate(bf16_dir: str | Path, fp8_dir: str | Path, device: str = "cpu", frames: int = 10, bound: float = 0.2,
             max_flip_share: float = 0.1) -> GateResult:
    return gate_models(load_model(bf16_dir, device=device, dtype=torch.bfloat16),
                       load_model(fp8_dir, device=device, dtype=torch.bfloat16), frames, bound, max_flip_share)


def gate_models(ref_lm: LoadedModel, q_lm: LoadedModel, frames: int = 10, bound: float = 0.2,
                max_flip_share: float = 0.1) -> GateResult:
    """run_gate on loaded models (both on one device)."""
    with torch.inference_mode():
        ref, q = GreedyRun(ref_lm, frames), GreedyRun(q_lm, frames)
        g = GreedyRun(q_lm, frames, graphs=True) if ref.engine.device.type == "cuda" else None
        followers = [q] if g is None else [q, g]
        for _ in range(frames):
            ref.next()
            for run in followers:
                run.next()
                run.follow(ref)
    main_ids = ref.engine.main_ids.tolist()
    decisions, flips, fast = 0, [], []
    for i, (fr, fq) in enumerate(zip(ref.frames, q.frames)):
        n, flip = compare_frame(i, fr, fq, ref.columns[i], q.columns[i], main_ids)
        decisions += n
        flips += [flip] if flip else []
        # a codebook's logits are comparable while the codes fed so far match: up to the frame's first mismatch
        fast += list(zip(fr.fast[: max(n - 1, 0)], fq.fast))
    rel = rel_error([(fr.slow, fq.slow) for fr, fq in zip(ref.frames, q.frames)])
    fast_err = rel_error(fast)
    near = sum(f.near_tie for f in flips)
    failures = [f"frame {f.frame} codebook {f.codebook}: margin {f.margin:.4f} > {NOISE_FACTOR:g} x noise "
                f"{f.noise:.4f}" for f in flips if not f.near_tie]
    if near > max_flip_share * decisions:
        failures.append(f"{near} near-tie flips in {decisions} decisions (at most {max_flip_share:g} of them)")
    if rel >= bound or fast_err >= bound:
        failures.append(f"relative logit error main {rel:.4f} / fast {fast_err:.4f} (bound {bound})")
    if g is not None and not all(torch.equal(a, b) for a, b in zip(q.columns, g.columns)):
        failures.append("the CUDA-graph FP8 frames differ from the eager FP8 frames")
    return GateResult(frames, decisions, flips, rel, fast_err, failures, not failures,
                      [c.tolist() for c in ref.columns], [c.tolist() for c in q.columns],
                      None if g is None else [c.tolist() for c in g.columns])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rtts.bench gate")
    p.add_argument("--checkpoint", help="bf16 checkpoint directory")
    p.add_argument("--fp8", help="its `rtts quantize` output")
    p.add_argument("--make-demo", help="write the demo gate model (and its FP8 copy) here and use it")
    p.add_argument("--device", default="cpu")
    p.add_argument("--frames", type=int, default=10)
    p.add_argument("--bound", type=float, default=0.2, help="max relative logit error")
    p.add_argument("--max-flip-share", type=float, default=0.1, help="near-tie flips accepted per decision compared")
    args = p.parse_args(argv)
    if args.make_demo:
        src, dst = make_demo(args.make_demo)
    else:
        if not (args.checkpoint and args.fp8):
            p.error("give --checkpoint and --fp8, or --make-demo DIR")
        src, dst = Path(args.checkpoint), Path(args.fp8)
    r = run_gate(src, dst, args.device, args.frames, args.bound, args.max_flip_share)
    print(json.dumps({k: v for k, v in asdict(r).items() if not k.startswith("columns")}, indent=1))
    for i, (a, b) in enumerate(zip(r.columns_bf16, r.columns_fp8)):
        print(f"frame {i}: bf16 {a}, fp8 {'same' if a == b else b}")
    for f in r.flips:
        print(f"frame {f.frame} codebook {f.codebook}: bf16 {f.bf16}, fp8 {f.fp8}, margin {f.margin:.4f} vs noise "
              f"{f.noise:.4f}: {'a near-tie' if f.near_tie else 'NOT a near-tie'}")
    graphs = "" if r.columns_fp8_graphs is None else ", CUDA-graph frames checked"
    print(f"gate {'PASSED' if r.passed else 'FAILED'}: {r.frames} frames, {r.decisions} decisions compared, "
          f"{len(r.near_ties)} near-tie flips accepted, max relative logit error main {r.max_rel_logit_error:.4f} / "
          f"fast {r.max_rel_fast_logit_error:.4f} (bound {args.bound}){graphs}")
    for x in r.failures:
        print(f"  {x}")
    sys.exit(0 if r.passed else 1)
