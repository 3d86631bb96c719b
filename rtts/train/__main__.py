"""`python -m rtts.train STAGE [options]`: the demo-voice recipe, one command per stage (docs/demo_voice.md).

Stages read and write under --workdir (default train/work/<preset>):
  sentences     rebuild train/sentences.txt.gz + train/heldout.txt from the installed packages
  flite-bundle  copy flite_cmu_us_rms and its libraries into a folder that travels to the GPU machine
  data          speak the training sentences with flite          -> WORKDIR/data/
  codec         train the codec (resumes)                        -> WORKDIR/codec/{codec.pth,codec_config.json}
  tokens        encode every utterance with the trained codec    -> WORKDIR/tokens/
  dualar        train the DualAR (resumes)                       -> WORKDIR/dualar/
  export        write the S2 checkpoint                          -> --out
  evaluate      Whisper WER/CER of the source voice or of a checkpoint served through the live WebSocket
  fit-check     the DualAR's teacher-forced losses on training vs held-out sentences (memorization shows here)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

TRAIN_DIR = Path(__file__).resolve().parents[2] / "train"
VALIDATION_FROM = 100  # train/heldout.txt: the first 100 for evaluation and the CI gate, the rest for validation


def _workdir(args: argparse.Namespace) -> Path:
    return Path(args.workdir) if args.workdir else TRAIN_DIR / "work" / args.preset


def _threads(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)


def cmd_sentences(args: argparse.Namespace) -> None:
    from rtts.train import sentences

    sentences.build(Path(args.out) if args.out else TRAIN_DIR)


def cmd_flite_bundle(args: argparse.Namespace) -> None:
    from rtts.train import flite

    out = flite.bundle(Path(args.out))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"flite bundle: {out} ({size / 1e6:.1f} MB)")


def cmd_data(args: argparse.Namespace) -> None:
    from rtts.train import dataset, flite, sentences
    from rtts.train.presets import PRESETS

    preset = PRESETS[args.preset]
    texts = sentences.read_lines(Path(args.sentences) if args.sentences else TRAIN_DIR / "sentences.txt.gz")
    count = args.count if args.count is not None else preset.sentences
    if count:
        texts = texts[:count]
    voice = flite.find(Path(args.bundle) if args.bundle else None)
    t0 = time.perf_counter()
    # A handful of sentences flite cannot speak must not end a GPU call's data stage.
    store = dataset.write(_workdir(args) / "data", flite.synthesize(voice, texts, args.processes, len(texts) // 100),
                          flite.SAMPLE_RATE, flite.VOICE_BINARY, log_every=2000)
    took = time.perf_counter() - t0
    print(f"data: {len(store.utts)} utterances, {store.seconds / 3600:.2f} h in {took:.0f} s "
          f"({store.seconds / max(took, 1e-9):.0f}x real time)")
    # Held-out sentences for the DualAR stage's validation loss (never trained on). Only those past the first
    # VALIDATION_FROM: the quality gate scores the first ones, and picking weights on them would flatter it.
    heldout = sentences.read_lines(TRAIN_DIR / "heldout.txt")[VALIDATION_FROM:]
    spoken = flite.synthesize(voice, heldout, args.processes, len(heldout) // 100)
    held = dataset.write(_workdir(args) / "heldout", spoken, flite.SAMPLE_RATE, flite.VOICE_BINARY)
    print(f"data: {len(held.utts)} held-out utterances for validation")


def cmd_codec(args: argparse.Namespace) -> None:
    from rtts.train import codec_train
    from rtts.train.dataset import Store
    from rtts.train.loop import pick_device
    from rtts.train.presets import PRESETS

    _threads(args)
    preset = PRESETS[args.preset]
    work = _workdir(args)
    cfg = preset.codec_training if args.steps is None else _replace(preset.codec_training, steps=args.steps)
    cfg = _overrides(cfg, args.set)
    out = codec_train.train(Store.load(work / "data"), work, preset.codec, cfg, pick_device(args.device),
                            minutes=args.minutes)
    if out is None:
        sys.exit(3)  # not finished: the budget ran out (the state is saved)
    print(f"codec: wrote {out}")


def cmd_tokens(args: argparse.Namespace) -> None:
    from rtts.train import tokens
    from rtts.train.dataset import Store
    from rtts.train.loop import pick_device

    _threads(args)
    work = _workdir(args)
    t0 = time.perf_counter()
    device = pick_device(args.device)
    toks = tokens.encode_store(Store.load(work / "data"), work / "codec", work / "tokens", device)
    print(f"tokens: {len(toks.texts)} utterances, {toks.codes.shape[1]} frames in {time.perf_counter() - t0:.0f} s")
    if (work / "heldout" / "meta.json").exists():  # inside tokens/, so it travels with them
        held = tokens.encode_store(Store.load(work / "heldout"), work / "codec", work / "tokens" / "heldout", device)
        print(f"tokens: {len(held.texts)} held-out utterances for validation")


def cmd_dualar(args: argparse.Namespace) -> None:
    from rtts.train import dualar_train
    from rtts.train.loop import pick_device
    from rtts.train.presets import PRESETS

    _threads(args)
    preset = PRESETS[args.preset]
    cfg = preset.dualar_training if args.steps is None else _replace(preset.dualar_training, steps=args.steps)
    if args.lr is not None:
        cfg = _replace(cfg, lr=args.lr)
    cfg = _overrides(cfg, args.set)
    init = Path(args.init_weights) if args.init_weights else None
    out = dualar_train.train(preset, _workdir(args), cfg, pick_device(args.device), minutes=args.minutes,
                             init_weights=init)
    if out is None:
        sys.exit(3)
    print(f"dualar: finished; weights in {_workdir(args) / dualar_train.WEIGHTS}.json")


def cmd_export(args: argparse.Namespace) -> None:
    from rtts.train import export

    out = export.export(_workdir(args), Path(args.out))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"export: {out} ({size / 1e6:.1f} MB): " + ", ".join(sorted(f.name for f in out.iterdir())))


def cmd_evaluate(args: argparse.Namespace) -> None:
    from rtts.train import evaluate, sentences

    _threads(args)
    texts = sentences.read_lines(Path(args.sentences) if args.sentences else TRAIN_DIR / "heldout.txt")[:args.count]
    report = evaluate.evaluate(texts, Path(args.report), checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                               url=args.url, bundle=Path(args.bundle) if args.bundle else None,
                               processes=args.processes, threads=args.threads or 1,
                               codec_dir=Path(args.codec) if args.codec else None,
                               sampling={k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p),
                                                           ("seed", args.seed)) if v is not None} or None)
    print(evaluate.table(report))
    print(f"report: {args.report} ({report['seconds']:.0f} s)")


def cmd_fit_check(args: argparse.Namespace) -> None:
    from rtts.train import fitcheck, sentences

    _threads(args)
    heldout = sentences.read_lines(Path(args.sentences) if args.sentences else TRAIN_DIR / "heldout.txt")
    result = fitcheck.fit_check(Path(args.checkpoint), _workdir(args) / "tokens", heldout, args.count, args.preset,
                                Path(args.report), Path(args.bundle) if args.bundle else None, args.processes)
    for name in ("train", "heldout"):
        print(f"{name}: " + " ".join(f"{k}={v}" for k, v in result[name].items()))


def _replace(obj, **changes):  # type: ignore[no-untyped-def]
    from dataclasses import replace

    return replace(obj, **changes)


def _overrides(cfg, sets: list[str]):  # type: ignore[no-untyped-def]
    """Apply `--set FIELD=VALUE` overrides to a training-settings dataclass (numbers and booleans)."""
    from dataclasses import fields

    types = {f.name: type(getattr(cfg, f.name)) for f in fields(cfg)}
    changes: dict[str, object] = {}
    for item in sets:
        name, _, value = item.partition("=")
        kind = types.get(name)
        if kind not in (int, float, bool) or not value:
            raise SystemExit(f"--set {item}: expected FIELD=VALUE with FIELD one of "
                             f"{', '.join(n for n, t in types.items() if t in (int, float, bool))}")
        changes[name] = value.lower() in ("1", "true", "yes") if kind is bool else kind(value)
    return _replace(cfg, **changes) if changes else cfg


def main(argv: list[str] | None = None) -> None:
    from rtts.train.presets import PRESETS

    p = argparse.ArgumentParser(prog="python -m rtts.train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)

    def stage(name: str, fn, help_: str) -> argparse.ArgumentParser:  # type: ignore[no-untyped-def]
        sp = sub.add_parser(name, help=help_)
        sp.set_defaults(fn=fn)
        sp.add_argument("--preset", choices=sorted(PRESETS), default="h200")
        sp.add_argument("--workdir", default=None, help="default: train/work/<preset>")
        sp.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
        return sp

    sp = stage("sentences", cmd_sentences, "rebuild the sentence lists from the installed packages")
    sp.add_argument("--out", default=None, help="folder for sentences.txt.gz + heldout.txt (default: train/)")
    sp = stage("flite-bundle", cmd_flite_bundle, "gather flite_cmu_us_rms and its libraries into a folder")
    sp.add_argument("--out", default=str(TRAIN_DIR / "bundle" / "flite"))
    sp = stage("data", cmd_data, "speak the training sentences with flite")
    sp.add_argument("--sentences", default=None, help="default: train/sentences.txt.gz")
    sp.add_argument("--count", type=int, default=None, help="how many sentences (default: the preset's)")
    sp.add_argument("--bundle", default=None, help="a folder made by flite-bundle (default: the system's flite)")
    sp.add_argument("--processes", type=int, default=1)
    sp = stage("tokens", cmd_tokens, "encode every utterance with the trained codec")
    sp.add_argument("--device", default=None)
    for name, fn, help_ in (("codec", cmd_codec, "train the codec"), ("dualar", cmd_dualar, "train the DualAR")):
        sp = stage(name, fn, help_)
        sp.add_argument("--device", default=None)
        sp.add_argument("--steps", type=int, default=None, help="override the preset's step count")
        sp.add_argument("--minutes", type=float, default=0.0, help="stop (saving state) after this long; 0: no limit")
        sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="override a training setting of the preset (presets.py), e.g. batch=4; repeatable")
        if name == "dualar":
            sp.add_argument("--init-weights", default=None,
                            help="start from these weights, with a new optimizer: an exported checkpoint folder or "
                                 "WORKDIR/dualar_weights of an earlier run")
            sp.add_argument("--lr", type=float, default=None, help="override the preset's peak learning rate")
    sp = stage("evaluate", cmd_evaluate, "Whisper WER/CER of the source voice (and of a served checkpoint)")
    sp.add_argument("--sentences", default=None, help="default: train/heldout.txt")
    sp.add_argument("--count", type=int, default=50)
    sp.add_argument("--checkpoint", default=None, help="serve this checkpoint in-process and score it")
    sp.add_argument("--url", default=None, help="score a running server instead (ws://host:port)")
    sp.add_argument("--codec", default=None, help="also score the source audio resynthesized by this codec folder")
    sp.add_argument("--bundle", default=None)
    sp.add_argument("--processes", type=int, default=1, help="flite processes for the source voice")
    sp.add_argument("--report", default="evaluate.json")
    sp.add_argument("--temperature", type=float, default=None, help="sent with each request (default: the server's)")
    sp.add_argument("--top-p", type=float, default=None, help="sent with each request (default: the server's)")
    sp.add_argument("--seed", type=int, default=None,
                    help="sent with each request (default: the server's; 20 sentences' WER moves ~10 points by seed)")
    sp = stage("fit-check", cmd_fit_check, "teacher-forced losses on training vs held-out sentences")
    sp.add_argument("--checkpoint", required=True)
    sp.add_argument("--sentences", default=None, help="held-out sentences (default: train/heldout.txt)")
    sp.add_argument("--count", type=int, default=40)
    sp.add_argument("--bundle", default=None)
    sp.add_argument("--processes", type=int, default=1, help="flite processes for the held-out audio")
    sp.add_argument("--report", default="fit-check.json")
    sp = stage("export", cmd_export, "write the S2 checkpoint")
    sp.add_argument("--out", required=True)
    args = p.parse_args(argv)
    args.fn(args)


if __name__ == "__main__":
    main()
