"""Implementations of the offline commands: synth, codec encode/decode, make-random-checkpoint."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from rtts.audio.io import read_audio, write_wav
from rtts.engine.engine import DEFAULT_PREFILL_ROWS, Engine
from rtts.engine.synth import Synthesizer
from rtts.model.codec import encode_audio, load_codec
from rtts.model.errors import PromptError
from rtts.model.loading import load_model
from rtts.model.prompt import PromptBuilder, Reference
from rtts.tools.demo_voice import demo_voice_dir
from rtts.tools.random_checkpoint import make_random_checkpoint
from rtts.types import SamplingParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
MAX_REFERENCE_SECONDS = 300.0


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but no CUDA device is available")
    return torch.device(name)


def resolve_checkpoint(path: str | None) -> Path:
    if path is None:
        d = demo_voice_dir()
        print(f"rtts: no --checkpoint given, using the embedded demo voice at {d} (its README.md says what it is)",
              file=sys.stderr)
        return d
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"--checkpoint {path}: directory not found")
    return p


def _log(msg: str) -> None:
    print(f"rtts: {msg}", file=sys.stderr)


def cmd_synth(args: argparse.Namespace) -> None:
    if not args.text.strip():
        raise ValueError("text is empty")
    if (args.reference_audio or args.reference_codes) and not args.reference_text:
        raise ValueError("--reference-text is required with --reference-audio / --reference-codes")
    if args.reference_text and not (args.reference_audio or args.reference_codes):
        raise ValueError("--reference-text needs --reference-audio or --reference-codes")
    if args.reference_audio and args.reference_codes:
        raise ValueError("give either --reference-audio or --reference-codes, not both")
    for opt in ("reference_audio", "reference_codes"):
        path = getattr(args, opt)
        if path and not Path(path).is_file():
            raise ValueError(f"--{opt.replace('_', '-')} {path}: file not found")
    ckpt = resolve_checkpoint(args.checkpoint)
    device, dtype = resolve_device(args.device), DTYPES[args.dtype]

    t0 = time.perf_counter()
    lm = load_model(ckpt, device=device, dtype=dtype)
    codec = load_codec(ckpt, device=device, dtype=torch.float32)
    _log(f"loaded {ckpt} ({lm.config.model_type}) in {time.perf_counter() - t0:.1f} s")
    fmt = lm.config.format
    builder = PromptBuilder(lm.tokenizer, lm.config.num_codebooks, fmt, lm.config.codebook_size)

    refs: list[Reference] = []
    if args.reference_audio:
        audio = read_audio(args.reference_audio, codec.config.sample_rate, MAX_REFERENCE_SECONDS)
        codes = encode_audio(codec, audio)
        refs.append(Reference(args.reference_text, codes))
    elif args.reference_codes:
        codes = builder.check_codes(_load_codes(args.reference_codes))
        refs.append(Reference(args.reference_text, codes))

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k if args.top_k is not None else (30 if fmt == "s2" else 0),
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        max_frames=args.max_frames,
    )
    params.validate()
    batches = builder.split_batches(args.text, args.chunk_length)
    # Size the KV cache to this request, not to the model's 32k positions.
    need = builder.system(refs).shape[1] + sum(builder.turn(b, i > 0).shape[1] + params.max_frames + 1
                                              for i, b in enumerate(batches))
    engine = Engine(lm, max_slots=1, max_ctx=need)
    synth = Synthesizer(engine)
    synth.start(refs)
    t1 = time.perf_counter()
    turns = [synth.turn(b, params) for b in batches]
    gen_s = time.perf_counter() - t1
    codes = torch.cat([t.codes for t in turns], dim=1)
    frames = codes.shape[1]
    if args.codes_out:
        np.save(args.codes_out, codes.numpy().astype(np.int64))
    if frames == 0:
        raise ValueError("the model produced no audio frames (it stopped at once)")
    with torch.inference_mode():
        wav = codec.decode(codes[None].to(codec.device))[0].float().cpu().numpy()
    write_wav(args.output, wav, codec.config.sample_rate)
    secs = frames * codec.config.frame_length / codec.config.sample_rate
    reasons = ",".join(t.finish.name.lower() for t in turns)
    _log(f"{frames} frames = {secs:.2f} s of audio in {gen_s:.2f} s ({frames / max(gen_s, 1e-9):.1f} frames/s, "
         f"finish: {reasons}) -> {args.output}")


def _load_codes(path: str) -> torch.Tensor:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{path}: file not found")
    try:
        arr = np.load(p, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a .npy array ({e})") from None
    if not np.issubdtype(arr.dtype, np.integer):
        raise PromptError(f"{path}: codes must be integers, got {arr.dtype}")
    return torch.from_numpy(arr.astype(np.int64))


def cmd_codec(args: argparse.Namespace) -> None:
    ckpt = resolve_checkpoint(args.checkpoint)
    device = resolve_device(args.device)
    codec = load_codec(ckpt, device=device, dtype=torch.float32)
    if args.codec_cmd == "encode":
        audio = read_audio(args.input, codec.config.sample_rate, MAX_REFERENCE_SECONDS)
        codes = encode_audio(codec, audio)
        np.save(args.output, codes.numpy().astype(np.int64))
        secs = audio.size / codec.config.sample_rate
        _log(f"{args.input}: {secs:.2f} s -> codes {list(codes.shape)} -> {args.output}")
    else:
        codes = _load_codes(args.input)
        if codes.ndim != 2 or codes.shape[0] != codec.config.num_codebooks or codes.shape[1] == 0:
            raise ValueError(f"{args.input}: codes must have shape [{codec.config.num_codebooks}, frames], "
                             f"got {list(codes.shape)}")
        with torch.inference_mode():
            wav = codec.decode(codes[None].to(device))[0].float().cpu().numpy()
        write_wav(args.output, wav, codec.config.sample_rate)
        _log(f"{args.input}: codes {list(codes.shape)} -> {wav.size / codec.config.sample_rate:.2f} s -> {args.output}")


def cmd_make_random(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    dtype = DTYPES[args.dtype] if args.dtype else None
    out = make_random_checkpoint(args.preset, args.out, seed=args.seed, dtype=dtype)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    _log(f"wrote {args.preset} to {out} ({size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s")


def cmd_serve(args: argparse.Namespace) -> None:
    from rtts.runtime import ServerConfig
    from rtts.voices import default_voices_dir
    from rtts.ws.server import serve

    if args.checkpoint is not None and not Path(args.checkpoint).is_dir():
        raise ValueError(f"--checkpoint {args.checkpoint}: directory not found")
    resolve_device(args.device)
    prefill_rows = DEFAULT_PREFILL_ROWS if args.prefill_rows is None else args.prefill_rows
    if args.max_running < 1 or args.max_ctx < 64 or prefill_rows < 1:
        raise ValueError("--max-running and --prefill-rows must be >= 1 and --max-ctx >= 64")
    if not args.drain_grace >= 0:  # (NaN too)
        raise ValueError("--drain-grace must be >= 0 seconds")
    voices = args.voices_dir or str(default_voices_dir())
    config = ServerConfig(
        checkpoint=args.checkpoint, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
        max_running=args.max_running, max_ctx=args.max_ctx, prefill_rows=prefill_rows,
        api_keys=tuple(args.api_key), voices_dir=voices,
        max_reference_seconds=args.max_reference_seconds, cuda_graphs=not args.no_cuda_graphs, freeze_gc=True,
        codec_graphs=args.codec_graphs, prefill_graphs=args.prefill_graphs, codec_tf32=args.codec_tf32,
        codec_dtype=args.codec_dtype, fp8=args.fp8, exit_on_failure=True, trim_when_idle=True,
        drain_grace=args.drain_grace,
    )
    if args.random_preset is None:
        serve(config)
        return
    from rtts.runtime import Runtime
    from rtts.tools.random_checkpoint import random_model

    dtype = torch.bfloat16 if args.device == "cuda" and args.dtype != "float32" else torch.float32
    loaded, codec = random_model(args.random_preset, resolve_device(args.device), dtype)
    if args.fp8:
        from rtts.model.quant import quantize_model_

        quantize_model_(loaded.model)
    _log(f"serving RANDOM weights of the {args.random_preset} preset (benchmarking only: the audio is noise)")
    serve(config, Runtime(config, loaded=loaded, codec=codec))


def cmd_voices(args: argparse.Namespace) -> None:
    """`rtts voices add|list|delete`: the store `rtts serve` reads (its --voices-dir default); a server already running
    on it sees a voice added, replaced or deleted here at its next use (VoiceStore reads the disk through). A clip is
    encoded by the codec of the checkpoint given (the one the server runs: codes from another codec would be another
    voice)."""
    from rtts.voices import VOICE_ID, VoiceMeta, VoiceStore, default_voices_dir, reference_encoder

    root = args.voices_dir or str(default_voices_dir())
    if args.voices_cmd != "add":
        store = VoiceStore(root, lambda audio: np.zeros((0, 0), np.int64))  # no encoding: list / delete only
        if args.voices_cmd == "list":
            for v in store.list():
                print(f"{v.id}\t{v.codes.shape[1]} frames\t{v.text}")
        elif not store.delete(args.voice_id):
            raise ValueError(f"no stored voice {args.voice_id!r} in {root}")
        return
    path = Path(args.audio)
    if not path.is_file():
        raise ValueError(f"{args.audio}: file not found")
    if not VOICE_ID.fullmatch(args.voice_id):  # before loading a codec for nothing
        raise ValueError(f"invalid voice id {args.voice_id!r}: use 1-128 letters, digits, '_', '-', '.'")
    if not args.text.strip():
        raise ValueError("--text is empty: give the clip's exact transcript")
    codec = load_codec(resolve_checkpoint(args.checkpoint), device=resolve_device(args.device), dtype=torch.float32)
    encode = reference_encoder(codec, args.max_reference_seconds, name=args.audio)  # errors name the file
    store = VoiceStore(root, encode, codebooks=codec.config.num_codebooks)
    voice = store.add(args.voice_id, path.read_bytes(), args.text, VoiceMeta(title=args.title))
    _log(f"stored voice {voice.id!r} ({voice.codes.shape[1]} frames) in {root}: send reference_id={voice.id!r}; "
         "a running `rtts serve` with this --voices-dir uses it from its next session, no restart needed")


def cmd_quantize(args: argparse.Namespace) -> None:
    from rtts.tools.quantize_checkpoint import quantize_checkpoint

    src = Path(args.src)
    if not src.is_dir():
        raise ValueError(f"{args.src}: directory not found")
    t0 = time.perf_counter()
    out = quantize_checkpoint(src, args.dst)
    _log(f"wrote FP8 checkpoint {out} in {time.perf_counter() - t0:.1f} s")
