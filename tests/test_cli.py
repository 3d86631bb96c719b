"""The command line on the golden checkpoints: synth, codec encode/decode, make-random-checkpoint, and user errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

from rtts.__main__ import main


def _fail(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("rtts: error: ")
    return err[-1]


def test_synth_greedy_matches_golden(golden: Path, tmp_path: Path) -> None:
    ckpt = golden / "tiny-s2"
    fx = ckpt / "fixtures" / "case1_ref"
    codes_out, wav = tmp_path / "codes.npy", tmp_path / "out.wav"
    main(["synth", "How are you doing today? I hope the weather is nice.", "--checkpoint", str(ckpt),
          "--reference-codes", str(fx / "ref_codes.npy"), "--reference-text",
          "The quick brown fox jumps over the lazy dog.", "--top-k", "1", "--temperature", "1.0", "--top-p", "0.9",
          "--max-frames", "24", "--codes-out", str(codes_out), "-o", str(wav)])
    assert np.array_equal(np.load(codes_out), np.load(fx / "b0.codes.npy"))
    audio, sr = sf.read(wav, dtype="float32")
    assert sr == 44100
    # 16-bit WAV: quantization error only.
    assert np.abs(audio - np.load(fx / "b0.codes_decoded.wav.npy")).max() < 1e-4


def test_synth_s1_greedy(golden: Path, tmp_path: Path) -> None:
    ckpt = golden / "tiny-s1"
    codes_out = tmp_path / "codes.npy"
    main(["synth", "Hello there! This is a tiny test of the speech model.", "--checkpoint", str(ckpt),
          "--temperature", "0.7", "--top-p", "0.0001", "--repetition-penalty", "1.0", "--max-frames", "24",
          "--codes-out", str(codes_out), "-o", str(tmp_path / "o.wav")])
    assert np.array_equal(np.load(codes_out), np.load(ckpt / "fixtures" / "case0_noref" / "b0.codes.npy"))


def test_synth_clones_from_reference_audio(golden: Path, encode1s_wav: Path, tmp_path: Path) -> None:
    ckpt = golden / "tiny-s2"
    wav = tmp_path / "o.wav"
    main(["synth", "Voice clone.", "--checkpoint", str(ckpt), "--reference-audio",
          str(encode1s_wav), "--reference-text", "Reference words.",
          "--seed", "7", "--max-frames", "12", "-o", str(wav)])
    audio, _ = sf.read(wav)
    assert 0 < audio.size <= 11 * 2048 and np.isfinite(audio).all()


def test_voices_add_list_delete(golden: Path, encode1s_wav: Path, tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    """`rtts voices add ID CLIP --text` stores what `rtts serve` loads as reference_id ID (codes from the checkpoint's
    codec, the same as `rtts codec encode` gives); list shows it; delete removes it; errors are one line."""
    from rtts.voices import VoiceStore

    ckpt, voices, clip = golden / "tiny-s2", tmp_path / "voices", encode1s_wav
    main(["voices", "add", "my-voice", str(clip), "--text", "Reference words.", "--title", "Me",
          "--checkpoint", str(ckpt), "--voices-dir", str(voices)])
    main(["codec", "encode", str(clip), str(tmp_path / "codes.npy"), "--checkpoint", str(ckpt)])
    v = VoiceStore(voices, lambda audio: np.zeros((0, 0), np.int64)).get("my-voice")
    assert v.text == "Reference words." and v.meta.title == "Me"
    assert np.array_equal(v.codes, np.load(tmp_path / "codes.npy"))
    capsys.readouterr()
    main(["voices", "list", "--voices-dir", str(voices)])
    assert capsys.readouterr().out.startswith(f"my-voice\t{v.codes.shape[1]} frames\tReference words.")
    main(["voices", "delete", "my-voice", "--voices-dir", str(voices)])
    (tmp_path / "junk.wav").write_bytes(b"not audio at all" * 10)
    for argv, needle in ((["voices", "delete", "my-voice"], "no stored voice"),
                         (["voices", "add", "bad id!", str(clip), "--text", "x"], "invalid voice id"),
                         (["voices", "add", "v", str(tmp_path / "missing.wav"), "--text", "x"], "not found"),
                         (["voices", "add", "v", str(clip), "--text", " "], "--text is empty"),
                         (["voices", "add", "v", str(clip), "--text", "x", "--checkpoint", str(ckpt),
                           "--max-reference-seconds", "0.5"], "limit"),  # serve's limit, not a longer one
                         (["voices", "add", "v", str(tmp_path / "junk.wav"), "--text", "x", "--checkpoint",
                           str(ckpt)], "junk.wav"),
                         (["voices", "list", "--voices-dir", str(clip)], "rtts: error")):  # a file, not a dir
        with pytest.raises(SystemExit):
            main(argv if "--voices-dir" in argv else [*argv, "--voices-dir", str(voices)])
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def test_codec_encode_decode(golden: Path, encode1s_wav: Path, tmp_path: Path) -> None:
    ckpt, codec_fx = golden / "tiny-s2", golden / "tiny-s2" / "fixtures" / "codec"
    main(["codec", "encode", str(encode1s_wav), str(tmp_path / "c.npy"), "--checkpoint", str(ckpt)])
    assert np.array_equal(np.load(tmp_path / "c.npy"), np.load(codec_fx / "encode1s.codes.npy"))
    main(["codec", "decode", str(codec_fx / "decode16.codes.npy"), str(tmp_path / "d.wav"), "--checkpoint", str(ckpt)])
    audio, _ = sf.read(tmp_path / "d.wav", dtype="float32")
    assert np.abs(audio - np.load(codec_fx / "decode16.wav.npy")).max() < 1e-4


def test_make_random_tiny_then_synth(tmp_path: Path) -> None:
    out = tmp_path / "tiny"
    main(["make-random-checkpoint", "--preset", "tiny", str(out)])
    main(["synth", "Random weights make noise.", "--checkpoint", str(out), "--seed", "1", "--max-frames", "8",
          "-o", str(tmp_path / "o.wav")])
    # Deterministic for a seed: the same preset and seed give the same bytes.
    again = tmp_path / "tiny2"
    main(["make-random-checkpoint", "--preset", "tiny", str(again)])
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (again / name).read_bytes()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["synth", "   ", "-o", "x.wav"], "text is empty"),
        (["synth", "hi", "-o", "x.wav", "--checkpoint", "/nonexistent"], "directory not found"),
        (["synth", "hi", "-o", "x.wav", "--reference-audio", "/nonexistent.wav", "--reference-text", "t"],
         "file not found"),
        (["synth", "hi", "-o", "x.wav", "--reference-text", "t"], "needs --reference-audio"),
        (["codec", "decode", "/nonexistent.npy", "o.wav"], "file not found"),
    ],
)
def test_bad_arguments_give_one_line(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str],
                                     golden: Path) -> None:
    if argv[0] == "codec":
        argv = argv + ["--checkpoint", str(golden / "tiny-s2")]
    assert needle in _fail(argv, capsys)


def test_unreadable_reference_audio(golden: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"not audio at all")
    msg = _fail(["synth", "hi", "-o", str(tmp_path / "o.wav"), "--checkpoint", str(golden / "tiny-s2"),
                 "--reference-audio", str(bad), "--reference-text", "t"], capsys)
    assert "cannot decode audio" in msg


def test_bad_reference_codes(golden: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    codes = tmp_path / "c.npy"
    np.save(codes, np.zeros((3, 5), dtype=np.int64))
    msg = _fail(["synth", "hi", "-o", str(tmp_path / "o.wav"), "--checkpoint", str(golden / "tiny-s2"),
                 "--reference-codes", str(codes), "--reference-text", "t"], capsys)
    assert "shape [10, frames]" in msg
