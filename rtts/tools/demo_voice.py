"""The demo voice packaged with rtts (`rtts/demo_voice/`): the checkpoint `rtts serve`, `rtts synth`, `rtts codec` and
`rtts voices add` use when no `--checkpoint` is given.

It is an ordinary S2-format checkpoint folder (made by `python -m rtts.train`, docs/demo_voice.md) and loads through the
same loaders as any `--checkpoint DIR`; what it is (source voice, language, sizes) is written in its own README.md,
which `summary` reads, so replacing the folder's files replaces every description of it.
"""

from __future__ import annotations

import re
from pathlib import Path

DEMO_VOICE_DIR = Path(__file__).resolve().parent.parent / "demo_voice"
# What the loaders need (tokenizer_config.json and special_tokens_map.json are optional to them).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "codec.pth", "codec_config.json")


def demo_voice_dir() -> Path:
    """The packaged demo voice's folder; a clear error when this installation lacks its files."""
    missing = [name for name in REQUIRED_FILES if not (DEMO_VOICE_DIR / name).is_file()]
    if missing:
        raise FileNotFoundError(f"the packaged demo voice is incomplete: {', '.join(missing)} missing from "
                                f"{DEMO_VOICE_DIR} (a partial installation?); pass --checkpoint DIR")
    return DEMO_VOICE_DIR


def summary(folder: str | Path = DEMO_VOICE_DIR) -> str:
    """The first paragraph of the folder's README.md as one line of plain text, without its parenthetical asides
    (file and package names) or code marks; '' when there is no README or it has no paragraph."""
    try:
        text = (Path(folder) / "README.md").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return ""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text)]
    body = next((p for p in paragraphs if p and not p.startswith("#")), "")
    plain = re.sub(r"\s*\([^()]*\)", "", body.replace("`", ""))
    return " ".join(plain.split())
