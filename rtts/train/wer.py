"""Word and character error rates after the normalization both sides get: lowercase, accents stripped, hyphens to
spaces, numbers below a thousand spelled out (Whisper writes "3 chemicals" for "three chemicals"; the held-out
sentences have no digits), punctuation stripped (apostrophes inside words kept: "don't" stays one word), whitespace
collapsed."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """0..999 -> words ("one hundred twenty three"); larger numbers stay digits."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        return _ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + number_words(n % 100))
    return str(n)


def normalize(text: str) -> str:
    t = unicodedata.normalize("NFKD", text)
    t = "".join(c for c in t if not unicodedata.combining(c))
    t = re.sub(r"\d+", lambda m: f" {number_words(int(m.group()))} ", t)
    t = t.lower().replace("-", " ").replace("\u2019", "'")
    t = re.sub(r"[^\w\s']", " ", t)
    t = re.sub(r"(?<!\w)'|'(?!\w)", " ", t)  # quotes, not apostrophes
    return " ".join(t.split())


def edit_distance(ref: Sequence[str], hyp: Sequence[str]) -> int:
    """Levenshtein distance (substitutions, insertions, deletions all cost 1)."""
    prev = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        cur = [i] + [0] * len(hyp)
        for j, h in enumerate(hyp, 1):
            cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h))
        prev = cur
    return prev[-1]


@dataclass(frozen=True)
class Score:
    word_errors: int
    words: int
    char_errors: int
    chars: int

    @property
    def wer(self) -> float:
        return self.word_errors / max(1, self.words)

    @property
    def cer(self) -> float:
        return self.char_errors / max(1, self.chars)

    def __add__(self, other: Score) -> Score:
        return Score(self.word_errors + other.word_errors, self.words + other.words,
                     self.char_errors + other.char_errors, self.chars + other.chars)


def score(reference: str, hypothesis: str) -> Score:
    """One utterance; corpus rates are sums of errors over sums of reference lengths (add the Scores)."""
    ref, hyp = normalize(reference), normalize(hypothesis)
    return Score(edit_distance(ref.split(), hyp.split()), len(ref.split()),
                 edit_distance(list(ref), list(hyp)), len(ref))


def corpus(pairs: Sequence[tuple[str, str]]) -> Score:
    total = Score(0, 0, 0, 0)
    for ref, hyp in pairs:
        total = total + score(ref, hyp)
    return total
