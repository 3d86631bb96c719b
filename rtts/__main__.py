"""`rtts` command line: serve | synth | codec | make-random-checkpoint.

Every user error (missing file, unreadable audio, empty text, a wrong checkpoint) ends in one line on stderr,
`rtts: error: ...`, and exit status 2; a traceback means a bug. `rtts serve` exits with status 3 when a worker thread
of the server died (its log says why; /v1/health answered 503 meanwhile): a supervisor should restart it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from rtts import env


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rtts", description="Real-time TTS for Fish Speech DualAR models.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("synth", help="synthesize one text to a WAV file")
    s.add_argument("text")
    s.add_argument("-o", "--output", required=True, help="output WAV path")
    s.add_argument("--checkpoint", help="checkpoint directory (default: the embedded demo voice)")
    s.add_argument("--reference-audio", help="voice to clone: an audio file")
    s.add_argument("--reference-codes", help="voice to clone: codec codes .npy [num_codebooks, frames]")
    s.add_argument("--reference-text", help="transcript of the reference")
    s.add_argument("--temperature", type=float, default=0.8)
    s.add_argument("--top-p", type=float, default=0.8)
    s.add_argument("--top-k", type=int, default=None, help="1 = greedy; default 30 (S2) or off (S1)")
    s.add_argument("--repetition-penalty", type=float, default=1.1, help="S1 models only")
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--max-frames", type=int, default=1024, help="max frames per text batch (21.5 frames = 1 s)")
    s.add_argument("--chunk-length", type=int, default=300, help="max UTF-8 bytes per batch of speaker turns")
    s.add_argument("--codes-out", help="also write the generated codes (.npy, int64 [num_codebooks, frames])")
    _device_args(s)

    v = sub.add_parser("serve", help="run the Fish Audio compatible server (WebSocket + HTTP)")
    v.add_argument("--checkpoint", help="checkpoint directory (default: the embedded demo voice, rtts/demo_voice)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8080)
    v.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    v.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    v.add_argument("--max-running", type=int, default=64, help="concurrent streams (one KV slot each)")
    v.add_argument("--max-ctx", type=int, default=4096, help="KV positions per stream")
    v.add_argument("--prefill-rows", type=int, default=None,
                   help="prompts per prefill batch (a burst of turns starts in batches of this many; default 16)")
    v.add_argument("--api-key", action="append", default=[], help="accepted Bearer key (repeatable); none = open")
    v.add_argument("--voices-dir", help="stored voices (default: $RTTS_HOME/voices)")
    v.add_argument("--max-reference-seconds", type=float, default=60.0)
    v.add_argument("--no-cuda-graphs", action="store_true")
    v.add_argument("--codec-graphs", action=argparse.BooleanOptionalAction, default=env.codec_graphs(),
                   help="decode audio chunks from CUDA graphs (default: on unless RTTS_CODEC_GRAPHS=0; CUDA only)")
    v.add_argument("--codec-tf32", action=argparse.BooleanOptionalAction, default=env.codec_tf32(),
                   help="run the codec's float32 convolutions (reference encode, and the audio decode with "
                        "--codec-dtype float32) on TF32 tensor cores (default: on unless RTTS_CODEC_TF32=0; CUDA only; "
                        "off: true float32, a float32 decode ~2.4x slower)")
    v.add_argument("--codec-dtype", choices=env.CODEC_DTYPES, default=env.codec_dtype(),
                   help="precision of the audio decode (default: auto = float16 on CUDA, float32 on CPU, or "
                        "RTTS_CODEC_DTYPE; half precision decodes from a copy of the codec, references still encode "
                        "in float32)")
    v.add_argument("--prefill-graphs", action=argparse.BooleanOptionalAction, default=env.prefill_graphs(),
                   help="replay prompt chunks from CUDA graphs (default: on unless RTTS_PREFILL_GRAPHS=0; CUDA only)")
    v.add_argument("--random-preset", choices=["s2-pro", "s1-mini", "tiny"],
                   help="benchmarking: serve random weights of a preset built in memory (no checkpoint)")
    v.add_argument("--fp8", action="store_true",
                   help="quantize the transformer linears to block FP8 at load (a checkpoint written by `rtts "
                        "quantize` is FP8 already; dimensions must be multiples of 128)")
    v.add_argument("--drain-grace", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, take no new sessions and give open ones this long to finish before the rest end "
                        "with an error, then exit 0 (/v1/health answers 503 draining meanwhile; default 30)")

    c = sub.add_parser("codec", help="encode audio to codes or decode codes to audio")
    csub = c.add_subparsers(dest="codec_cmd", required=True)
    for name, (i, o) in {"encode": ("WAV", "OUT.npy"), "decode": ("CODES.npy", "OUT.wav")}.items():
        cc = csub.add_parser(name)
        cc.add_argument("input", metavar=i)
        cc.add_argument("output", metavar=o)
        cc.add_argument("--checkpoint", help="checkpoint directory holding codec.pth (default: the demo voice)")
        cc.add_argument("--device", choices=["cpu", "cuda"], default="cpu")

    vo = sub.add_parser("voices", help="stored voices (a voice's id is the reference_id clients send)")
    vsub = vo.add_subparsers(dest="voices_cmd", required=True)
    va = vsub.add_parser("add", help="store a voice from a clip of the speaker and its exact transcript")
    va.add_argument("voice_id")
    va.add_argument("audio", help="the clip (WAV, FLAC, OGG, MP3)")
    va.add_argument("--text", required=True, help="the clip's exact transcript")
    va.add_argument("--title", default="", help="a display name (the SDK's voice title)")
    va.add_argument("--checkpoint", help="the checkpoint whose codec encodes the clip: the one `rtts serve` will use "
                                         "(default: the embedded demo voice)")
    va.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    va.add_argument("--max-reference-seconds", type=float, default=60.0,
                    help="the longest clip (rtts serve's limit for references, default 60)")
    for name, helptext in (("list", "list the stored voices"), ("delete", "delete a stored voice")):
        vx = vsub.add_parser(name, help=helptext)
        if name == "delete":
            vx.add_argument("voice_id")
    for vx in (va, *(vsub.choices[n] for n in ("list", "delete"))):
        vx.add_argument("--voices-dir", help="stored voices (default: $RTTS_HOME/voices, where `rtts serve` looks)")

    qz = sub.add_parser("quantize", help="write a block-scaled FP8 copy of a checkpoint (serve it with --checkpoint)")
    qz.add_argument("src")
    qz.add_argument("dst")

    m = sub.add_parser("make-random-checkpoint", help="write random weights in a release layout")
    m.add_argument("--preset", choices=["s2-pro", "s1-mini", "tiny"], required=True)
    m.add_argument("out")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="LLM weight dtype (default: bfloat16 for s2-pro/s1-mini, float32 for tiny)")
    return p


def _device_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # Imported late: `rtts --help` must not pay for torch.
    from rtts import cli
    from rtts.audio.io import AudioError
    from rtts.model.errors import CheckpointError, PromptError

    handlers = {"synth": cli.cmd_synth, "codec": cli.cmd_codec, "make-random-checkpoint": cli.cmd_make_random,
                "serve": cli.cmd_serve, "quantize": cli.cmd_quantize, "voices": cli.cmd_voices}
    try:
        handlers[args.command](args)
    except (CheckpointError, PromptError, AudioError, ValueError, OSError) as e:
        print(f"rtts: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
