"""FP8 correctness gate: greedy decode of the FP8 serving path vs bf16 on fixed inputs.

`python -m rtts.bench gate --checkpoint BF16_DIR --fp8 FP8_DIR [--device cuda]` (or `--make-demo OUT` first, which
writes a small S2-format model whose logits are far from flat, plus its FP8 copy). Passes when the first `--frames`
frames (every codebook) are token-identical and the relative error of the main-token logits stays under `--bound`.
On CUDA the FP8 frames are also decoded the way the server decodes them, replayed from CUDA graphs, and must match
too.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from rtts.engine.engine import Engine
from rtts.engine.graphs import DecodeRunner, FrameZeroRunner
from rtts.model.codec import random_codec_state_dict
from rtts.model.loading import LoadedModel, load_model
from rtts.model.prompt import PromptBuilder
from rtts.model.quant import quantize_checkpoint
from rtts.model.random_checkpoint import codec_config_for, parameter_shapes, to_release_key, write_tokenizer
from rtts.model.safetensors_writer import write_safetensors
from rtts.types import SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog."

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
    """A small S2-format model (all dims multiples of 128) whose greedy decisions are not on a knife's edge, and its
    `rtts quantize` copy. Returns (bf16 dir, fp8 dir).

    With random weights every logit is within a percent or two of the next, closer than FP8 rounding, so any FP8
    path would "fail". Here the residual branches (attention `wo`, MLP `w2`) are scaled by `branch_gain`, so the
    hidden state is dominated by its (exact, bf16) input embedding plus a smaller FP8-computed correction, and the
    tied head is scaled by `head_gain`: decisions have clear margins while every FP8 GEMM still contributes."""
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


@dataclass
class GateResult:
    frames: int
    equal_frames: int  # leading frames identical in every row
    max_rel_logit_error: float
    passed: bool
    columns_bf16: list[list[int]]
    columns_fp8: list[list[int]]
    # CUDA only: the FP8 model's frames replayed from the serving path's CUDA graphs (None elsewhere); the gate then
    # also needs them token-identical to the eager FP8 frames
    columns_fp8_graphs: list[list[int]] | None = None


def greedy_frames(lm: LoadedModel, frames: int, graphs: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Teacher-free greedy decode of `frames` frames -> (columns [rows, frames], main logits per frame).

    graphs=True (CUDA): as the server runs it, frame 0 and every decode step replayed from the CUDA graphs the
    scheduler captures (graphs.FrameZeroRunner, graphs.DecodeRunner); the logits are then not traced (empty list)."""
    engine = Engine(lm, max_slots=1, max_ctx=512)
    logits: list[torch.Tensor] = []
    runner = None
    if graphs:
        FrameZeroRunner(engine, use_graphs=True).capture()
        runner = DecodeRunner(engine, use_graphs=True)
        runner.capture()
    else:
        engine.trace = lambda name, t: logits.append(t[0].float().cpu()) if name == "slow_logits" else None
    builder = PromptBuilder(lm.tokenizer, lm.config.num_codebooks, lm.config.format, lm.config.codebook_size)
    engine.reset_slot(0)
    engine.set_params(0, SamplingParams(temperature=1.0, top_p=1.0, top_k=1, max_frames=frames + 1))
    engine.prefill(0, builder.system())
    first = engine.prefill(0, builder.turn(TEXT), sample=True)
    assert first is not None
    cols = [first]
    for _ in range(frames - 1):
        if runner is None:
            c, _ = engine.decode([0])
        else:  # the decode thread's call: kv_len bounds the slot's context plus the position fed now
            c, _ = runner.step([0], engine.host_pos[0] + 1)
            engine.host_pos[0] += 1
        cols.append(c[0].clone())
    return torch.stack([c.cpu() for c in cols], 1), logits[:frames]


def run_gate(bf16_dir: str | Path, fp8_dir: str | Path, device: str = "cpu", frames: int = 5,
             bound: float = 0.2) -> GateResult:
    ref = load_model(bf16_dir, device=device, dtype=torch.bfloat16)
    q = load_model(fp8_dir, device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        c_ref, l_ref = greedy_frames(ref, frames)
        c_q, l_q = greedy_frames(q, frames)
        c_g = greedy_frames(q, frames, graphs=True)[0] if torch.device(device).type == "cuda" else None
    equal = 0
    for f in range(frames):
        if not torch.equal(c_ref[:, f], c_q[:, f]) or (c_g is not None and not torch.equal(c_ref[:, f], c_g[:, f])):
            break
        equal += 1
    rel = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(l_ref, l_q))
    return GateResult(frames, equal, rel, equal == frames and rel < bound, c_ref.T.tolist(), c_q.T.tolist(),
                      None if c_g is None else c_g.T.tolist())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m rtts.bench gate")
    p.add_argument("--checkpoint", help="bf16 checkpoint directory")
    p.add_argument("--fp8", help="its `rtts quantize` output")
    p.add_argument("--make-demo", help="write the demo gate model (and its FP8 copy) here and use it")
    p.add_argument("--device", default="cpu")
    p.add_argument("--frames", type=int, default=5)
    p.add_argument("--bound", type=float, default=0.2)
    args = p.parse_args(argv)
    if args.make_demo:
        src, dst = make_demo(args.make_demo)
    else:
        if not (args.checkpoint and args.fp8):
            p.error("give --checkpoint and --fp8, or --make-demo DIR")
        src, dst = Path(args.checkpoint), Path(args.fp8)
    r = run_gate(src, dst, args.device, args.frames, args.bound)
    print(json.dumps(vars(r), indent=1))
    print(f"gate {'PASSED' if r.passed else 'FAILED'}: {r.equal_frames}/{r.frames} frames token-identical, "
          f"max relative main-logit error {r.max_rel_logit_error:.4f} (bound {args.bound})")
    sys.exit(0 if r.passed else 1)
