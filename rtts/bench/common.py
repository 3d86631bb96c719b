"""What every benchmark result records: command, commit, hardware, software, date."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

# The command line a result records: a script's own (a probe: `python bench/probes/x.py ...`), or what
# rtts.bench.__main__ sets before it consumes the subcommand (`python -m rtts.bench kernels ...`).
COMMAND: list[str] = ["python", *sys.argv]


def _git() -> tuple[str, bool]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=False).stdout.strip() or "unknown"
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, check=False).stdout.strip())
    except OSError:
        return "unknown", False
    return commit, dirty


def environment() -> dict[str, Any]:
    if os.environ.get("RTTS_COMMIT"):  # the device machine gets a copy of the tree without .git
        commit, dirty = os.environ["RTTS_COMMIT"], False
    else:
        commit, dirty = _git()
    env: dict[str, Any] = {
        "command": " ".join(COMMAND),
        "commit": commit + ("-dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


def write_results(out_dir: str | Path, name: str, data: dict[str, Any], table: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    gpu = data.get("env", {}).get("gpu", "cpu").lower().replace("nvidia ", "").replace(" ", "-")
    stem = f"{name}-{gpu}-{datetime.date.today().isoformat()}"
    jp, mp = out / f"{stem}.json", out / f"{stem}.md"
    jp.write_text(json.dumps(data, indent=2))
    env = data.get("env", {})
    header = "\n".join(f"- {k}: `{v}`" for k, v in env.items())
    mp.write_text(f"# {name}\n\n{header}\n\n{table}\n")
    return jp, mp
