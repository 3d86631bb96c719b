"""Training state on disk: saved every N steps, resumed on the next run, no file over the machine's 16 MB return limit.

A state is one `torch.save` blob (model, optimizer, step, anything picklable by `weights_only` loading) cut into
`<name>.partNNN` files of at most PART_BYTES, plus `<name>.json` naming the parts and their total size. The json is
written last (atomically), so a run killed mid-save leaves the previous complete state readable.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import torch

PART_BYTES = 15 * 1000 * 1000  # under the 16 MiB per-file limit of what comes back from the GPU machine


def save(directory: Path, name: str, state: dict[str, Any], part_bytes: int = PART_BYTES) -> list[Path]:
    """Write `state` as parts + manifest; -> the files written (manifest last). Old parts beyond the new count go."""
    directory.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    blob = buf.getbuffer()
    parts: list[Path] = []
    for i, start in enumerate(range(0, max(len(blob), 1), part_bytes)):
        path = directory / f"{name}.part{i:03d}"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(blob[start:start + part_bytes])
        os.replace(tmp, path)
        parts.append(path)
    manifest = directory / f"{name}.json"
    tmp = manifest.with_name(manifest.name + ".tmp")
    tmp.write_text(json.dumps({"parts": [p.name for p in parts], "bytes": len(blob)}) + "\n")
    os.replace(tmp, manifest)
    for stale in directory.glob(f"{name}.part*"):
        if stale not in parts and not stale.name.endswith(".tmp"):
            stale.unlink()
    return [*parts, manifest]


def exists(directory: Path, name: str) -> bool:
    return (directory / f"{name}.json").is_file()


def remove(directory: Path, name: str) -> None:
    """Delete a saved state (manifest first, so a half-deleted one never reads as present)."""
    (directory / f"{name}.json").unlink(missing_ok=True)
    for part in directory.glob(f"{name}.part*"):
        part.unlink()


def load(directory: Path, name: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    manifest = json.loads((directory / f"{name}.json").read_text())
    blob = b"".join((directory / part).read_bytes() for part in manifest["parts"])
    if len(blob) != manifest["bytes"]:
        raise ValueError(f"{directory / name}: parts hold {len(blob)} bytes, manifest says {manifest['bytes']}")
    state: dict[str, Any] = torch.load(io.BytesIO(blob), map_location=map_location, weights_only=True)
    return state
