"""Text buffering and segmentation for a live session (docs/protocol.md): `text` events in, synthesis segments out.

Fish semantics: the server buffers text and starts a generation per segment; `chunk_length` is the most characters in
one segment, `min_chunk_length` the fewest before a sentence end may close a segment; `flush` synthesizes everything
buffered and `stop` flushes the rest. Clients differ a lot: voice agents (LiveKit, Pipecat) send one whole sentence and
then `flush`, SDK users stream word pieces with no flush at all, so the rules below must give good segments for both.

Rules, in order, each time text arrives:
1. The earliest *confirmed* sentence end that closes a segment of >= min_chunk_length (and <= chunk_length) chars.
   A sentence end is a run of terminators (. ! ? … 。 ！ ？ and kin) plus closing quotes/brackets, confirmed by what
   follows: whitespace, or a CJK character; a CJK full stop needs nothing after it. A run of only dots (a period or an
   ellipsis) is also checked against its neighbours, so "Mr. Smith", "e.g. this", "U.S. Army" and "3. 5" do not end
   sentences: it needs the next word to be known, which costs nothing for clients that flush.
   A blank line (paragraph break) is a sentence end too.
2. Otherwise, once the buffer holds more than chunk_length chars, cut within the first chunk_length chars at the last
   sentence end, else the last clause mark (, ; : — 、 ， …), else the last whitespace, else the last boundary next to a
   CJK character, else hard at chunk_length. Each kind is first tried at positions that keep the segment at or above
   min_chunk_length, then anywhere.
3. `flush` treats the end of the buffer as confirmed and applies the same rules until the buffer is empty, so
   `push(a); push(b); flush()` segments the same text the same way as `push(a + b); flush()` in practice.

No cut ever falls inside a short tag: `<|speaker:N|>`, `<|...|>` control tokens, `(excited)`, `[laughing]`. While text
is still arriving an unclosed tag at the end of the buffer is protected too. Segments are stripped; segments with
nothing to say (whitespace, punctuation, or only speaker tags) are dropped. When a speaker turn is cut into several
segments, the later ones get the turn's `<|speaker:N|>` tag again (each segment is a separate generation, and without
the tag the model would not know who is speaking); this can make such a segment exceed chunk_length by the tag.

Lengths are Python `str` lengths (code points), the unit of Fish's "characters". Everything is deterministic.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass, field

__all__ = ["Segmenter"]

# Terminators. CJK full-width stops end a sentence by themselves (CJK has no spaces).
_TERMINATORS = frozenset(".!?…‼⁇⁈⁉。！？｡．।॥؟۔։።")
_CJK_TERMINATORS = frozenset("。！？｡．")
_DOTS = frozenset(".…")  # ambiguous terminators: also abbreviations, initials, decimals, trailing-off speech
_CLOSERS = frozenset("\"'”’»)]}」』）】》〉›")
_CLAUSE = frozenset(",;:—–、，；：﹐﹑،؛")
_CLAUSE_NO_SPACE = frozenset("—、，；：﹐﹑")  # these close a clause even when glued to the next word

# Words that a following period does not end (case-sensitive: "no." at the end of a sentence is common).
_ABBREVIATIONS = frozenset(
    "Mr Mrs Ms Mx Dr Prof Sr Jr St Mt Fig Figs Vol Inc Ltd Co Corp Gen Col Lt Sgt Capt Rev Hon vs approx".split()
)

# Short tags that must stay whole. Long parentheticals are ordinary prose and may be split.
_TAG_RE = re.compile(r"<\|[^<>|\n]{1,64}\|>|\([^()\[\]\n]{1,48}\)|\[[^\[\]()\n]{1,48}\]")
_SPEAKER_RE = re.compile(r"<\|speaker:\d+\|>")
_CONTROL_TOKEN_RE = re.compile(r"<\|[^<>|\n]{1,64}\|>")
_OPENERS = (("<|", "|>", 66), ("(", ")", 50), ("[", "]", 50))  # opener, closer, how far back an open tag may start

# Scan only this far past chunk_length: cuts never land beyond chunk_length, and this margin covers a tag straddling
# the limit and the look-ahead that confirms a sentence end. It keeps a huge push linear instead of quadratic.
_LOOKAHEAD = 96


def _is_cjk(ch: str) -> bool:
    """Han, kana and half-width kana: scripts written without spaces, where any character boundary is a word boundary.
    Hangul is excluded on purpose: Korean separates words with spaces."""
    o = ord(ch)
    return (
        0x3040 <= o <= 0x30FF  # hiragana, katakana
        or 0x3400 <= o <= 0x4DBF  # CJK extension A
        or 0x4E00 <= o <= 0x9FFF  # CJK unified ideographs
        or 0xF900 <= o <= 0xFAFF  # compatibility ideographs
        or 0xFF66 <= o <= 0xFF9F  # half-width katakana
        or 0x20000 <= o <= 0x2FA1F  # extensions B.. and compatibility supplement
    )


@dataclass
class _Candidates:
    """Cut positions p (the segment is text[:p]) of each kind, ascending."""

    blocked: bytearray  # blocked[p] = 1: p is inside a tag
    sentence: list[int] = field(default_factory=list)
    clause: list[int] = field(default_factory=list)
    space: list[int] = field(default_factory=list)
    cjk: list[int] = field(default_factory=list)


def _blocked_positions(view: str, tail_open: bool) -> bytearray:
    """blocked[p] = 1 when cutting at p would split a tag (or, while text is arriving, an unclosed tag at the end)."""
    blocked = bytearray(len(view) + 1)
    for m in _TAG_RE.finditer(view):
        blocked[m.start() + 1 : m.end()] = b"\x01" * (m.end() - m.start() - 1)
    if tail_open:
        for opener, closer, reach in _OPENERS:
            start = view.rfind(opener, max(0, len(view) - reach))
            if start >= 0 and view.find(closer, start + len(opener)) < 0:
                blocked[start + 1 :] = b"\x01" * (len(view) - start)
    return blocked


def _word_before(text: str, i: int) -> str:
    """The alphanumeric run ending just before index i ("Smith" in "Mr. Smith" is after; "Mr" is before the '.')."""
    j = i
    while j > 0 and text[j - 1].isalnum():
        j -= 1
    return text[j:i]


def _dot_ends_sentence(text: str, i: int, run: str, after: int, final: bool) -> bool:
    """A run of '.'/'…' at text[i:] followed by whitespace at `after`: does a sentence end here?"""
    if run == ".":
        word = _word_before(text, i)
        if word in _ABBREVIATIONS:
            return False
        if len(word) == 1 and word.isalpha() and not _is_cjk(word):  # initials and dotted acronyms: J. Smith, U.S.
            return False
    k = after
    while k < len(text) and text[k].isspace():
        k += 1
    if k == len(text):
        return final  # the next word decides; at the end of a flush there is none
    nxt = text[k]
    return not (nxt.islower() or nxt.isdigit())


def _scan(view: str, final: bool) -> _Candidates:
    """All cut positions in `view`. `final`: view is the whole buffer and its end is a confirmed boundary (flush)."""
    n = len(view)
    blocked = _blocked_positions(view, tail_open=not final)
    out = _Candidates(blocked)

    def add(kind: list[int], p: int) -> None:
        if 0 < p <= n and not blocked[p] and (not kind or kind[-1] < p):
            kind.append(p)

    i = 0
    while i < n:
        ch = view[i]
        if ch in _TERMINATORS and not blocked[i]:  # "(wow!)" is a tag, not the end of a sentence
            j = i
            while j < n and view[j] in _TERMINATORS:
                j += 1
            run = view[i:j]
            while j < n and view[j] in _CLOSERS:
                j += 1
            if _terminator_confirmed(view, i, run, j, final):
                add(out.sentence, j)
            i = j
            continue
        if ch.isspace():
            j = i
            while j < n and view[j].isspace():
                j += 1
            newlines = view.count("\n", i, j)
            if newlines >= 2:
                add(out.sentence, i)  # paragraph break
            elif newlines == 1:
                add(out.clause, i)  # a line break (list item, heading) is at least a clause boundary
            add(out.space, i)
            i = j
            continue
        if ch in _CLAUSE and not blocked[i]:
            j = i + 1
            while j < n and view[j] in _CLOSERS:
                j += 1
            if j < n and (view[j].isspace() or ch in _CLAUSE_NO_SPACE or _is_cjk(view[j])):
                add(out.clause, j)
        if _is_cjk(ch):
            add(out.cjk, i)
            add(out.cjk, i + 1)
        i += 1
    # A speaker change is a turn boundary, as good as a sentence end (the reference batches by turns too).
    turns = [m.start() for m in _SPEAKER_RE.finditer(view) if m.start() > 0]
    out.sentence = sorted(set(out.sentence).union(turns))
    return out


def _terminator_confirmed(view: str, i: int, run: str, p: int, final: bool) -> bool:
    if any(c in _CJK_TERMINATORS for c in run):
        return True
    if p == len(view):
        return final
    nxt = view[p]
    if _is_cjk(nxt):
        return True
    if not nxt.isspace():
        return False  # "3.5", "example.com", "?!x": not a boundary
    if all(c in _DOTS for c in run):
        return _dot_ends_sentence(view, i, run, p, final)
    return True


def _speakable(segment: str) -> bool:
    """Anything for the model to say: a letter or digit outside `<|...|>` tokens (a bare "(laughs)" counts)."""
    return any(c.isalnum() for c in _CONTROL_TOKEN_RE.sub("", segment))


@dataclass
class Segmenter:
    """Buffers a session's text and hands out synthesis segments (see the module docstring for the rules).

    The fields may be changed between calls (e.g. a smaller min_chunk_length for the first segment of a low-latency
    session); they apply from the next push/flush on.
    """

    chunk_length: int = 200
    min_chunk_length: int = 50
    carry_speaker: bool = True  # repeat the current <|speaker:N|> tag on later segments of the same turn
    _buf: str = field(default="", init=False, repr=False)
    _speaker: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.chunk_length < 1:
            raise ValueError(f"chunk_length must be >= 1, got {self.chunk_length}")
        if self.min_chunk_length < 0:
            raise ValueError(f"min_chunk_length must be >= 0, got {self.min_chunk_length}")

    @property
    def pending(self) -> str:
        """The buffered text not yet handed out (leading whitespace dropped)."""
        return self._buf

    def push(self, text: str) -> list[str]:
        """Append text; return the segments that are complete now (possibly none)."""
        self._buf = (self._buf + text).lstrip()
        return self._drain(final=False)

    def flush(self) -> list[str]:
        """Everything buffered, as segments of at most chunk_length characters. The buffer is empty afterwards."""
        segments = self._drain(final=True)
        self._buf = ""  # only whitespace can be left, and only if nothing was speakable
        return segments

    def clear(self) -> str:
        """Drop the buffer (cancel / barge-in) and forget the current speaker; return the dropped text."""
        dropped, self._buf, self._speaker = self._buf, "", None
        return dropped

    # -------------------------------------------------------------------------------------------------------- internals

    def _drain(self, final: bool) -> list[str]:
        out: list[str] = []
        while self._buf:
            cut = self._next_cut(final)
            if cut is None:
                break
            segment, self._buf = self._buf[:cut].strip(), self._buf[cut:].lstrip()
            emitted = self._emit(segment)
            if emitted is not None:
                out.append(emitted)
        return out

    def _next_cut(self, final: bool) -> int | None:
        """Where the next segment ends, or None to wait for more text."""
        limit = self.chunk_length
        min_len = min(self.min_chunk_length, limit)
        view = self._buf[: limit + _LOOKAHEAD]
        whole = len(view) == len(self._buf)
        cands = _scan(view, final and whole)
        for p in cands.sentence:  # rule 1: the earliest sentence end long enough
            if p > limit:
                break
            if p >= min_len:
                return p
        if len(self._buf) <= limit:
            return len(self._buf) if final else None
        if final and whole and len(self._buf.rstrip()) <= limit:
            return len(self._buf)
        return self._window_cut(view, cands, limit, min_len)

    def _window_cut(self, view: str, cands: _Candidates, limit: int, min_len: int) -> int:
        """Rule 2: the buffer is longer than chunk_length; cut inside its first chunk_length characters."""
        kinds = (cands.sentence, cands.clause, cands.space, cands.cjk)
        for lowest in (max(min_len, 1), 1):
            for positions in kinds:
                best = max((p for p in positions if lowest <= p <= limit), default=None)
                if best is not None:
                    return best
        return _hard_cut(view, cands.blocked, limit)

    def _emit(self, segment: str) -> str | None:
        tags = _SPEAKER_RE.findall(segment)
        if not _speakable(segment):
            if tags:
                self._speaker = tags[-1]  # a bare speaker tag still switches the speaker for what follows
            return None
        if self.carry_speaker and self._speaker is not None and not _SPEAKER_RE.match(segment):
            segment = self._speaker + segment
        if tags:
            self._speaker = tags[-1]
        return segment


def _hard_cut(view: str, blocked: bytearray, limit: int) -> int:
    """Cut at `limit`, but not inside a tag and not between a character and its combining marks."""
    p = limit
    while p > 1 and (blocked[p] or unicodedata.combining(view[p])):
        p -= 1
    if blocked[p]:  # a tag (or an unclosed one) spans the whole window: cut right after it instead
        p = limit
        while p < len(view) and blocked[p]:
            p += 1
    return p
