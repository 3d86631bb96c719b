"""The demo voice's quality gate, offline on CPU: Whisper tiny.en transcribes held-out sentences that the packaged
default model speaks through a real server's live WebSocket, with default settings, and the source voice (flite
cmu_us_rms, what the model was trained to imitate) speaking the same sentences beside it.

The sentences are the first of train/heldout.txt: digit-free, never trained on, and not the ones training validates
on (rtts/train/__main__.py VALIDATION_FROM). The printed table carries WER and CER of both voices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import system_tool

from rtts.tools.demo_voice import demo_voice_dir
from rtts.train import evaluate, sentences
from rtts.train.__main__ import TRAIN_DIR, VALIDATION_FROM

SENTENCES = 20
# Bound for the voice now in rtts/demo_voice (35.9% WER at server defaults, deterministic on the dev box; bench/results/
# demo_voice/README.md): a gate against regressions (random weights, a broken codec path or a mangled stream score
# ~100%, earlier weights 46-81%), not yet the 30% the voice must reach (issue 24); a voice that reaches it lowers this
# to 0.30.
WER_MAX = 0.42
# A model that stops too early or never stops: the spoken length against the source voice's, per sentence and median.
LENGTH_RATIO = (0.5, 2.0)
MEDIAN_LENGTH_RATIO = (0.75, 1.35)


@pytest.mark.slow
def test_demo_voice_is_intelligible_through_the_live_websocket(tmp_path: Path) -> None:
    system_tool("flite_cmu_us_rms")
    texts = sentences.read_lines(TRAIN_DIR / "heldout.txt")[:SENTENCES]
    assert SENTENCES <= VALIDATION_FROM and all(not any(c.isdigit() for c in t) for t in texts)
    report = evaluate.evaluate(texts, tmp_path / "gate.json", checkpoint=demo_voice_dir(), processes=2, threads=2)
    print("\n" + evaluate.table(report))
    source, served = report["source"], report["server"]
    assert source["summary"]["wer"] <= 0.2, "the source voice or the ASR is broken: nothing below can be trusted"
    assert served["summary"]["finish"] == {"stop": SENTENCES}, served["summary"]["finish"]
    ratios = [s["seconds"] / r["seconds"] for s, r in zip(served["items"], source["items"])]
    assert all(LENGTH_RATIO[0] <= x <= LENGTH_RATIO[1] for x in ratios), ratios
    lo, hi = MEDIAN_LENGTH_RATIO
    assert lo <= served["summary"]["length_ratio_median"] <= hi
    assert served["summary"]["wer"] <= WER_MAX, served["summary"]
