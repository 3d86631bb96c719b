"""Repository invariants: the README's commands, CI entry point, and the import direction between layers."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.strip().splitlines()]


def test_ci_runs_the_readme_test_command() -> None:
    install_run, install_test = _readme_commands()[:2]
    ci = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert install_test in ci
    assert "pytest" in install_test and "[test]" in install_test
    assert install_run.startswith("pip install") and " rtts " in f" {install_run} "


def test_required_top_level() -> None:
    for p in ["pyproject.toml", "rtts", "rtts/kernels", "rtts/pingpong", "rtts/ws", "cuda", "clients", "tests",
              "latency_reports"]:
        assert (ROOT / p).exists(), p


# Each layer may import only the layers to its right (ws -> runtime -> session -> pingpong -> engine -> model ->
# kernels); `runtime` (rtts/runtime.py, rtts/metrics.py) is what the server process owns, which transports use;
# results travel back through outboxes, never through an upward import. `tools` (checkpoint makers) stands beside the
# flow, above the model it builds checkpoints for: tools may import model and kernels, model never imports tools.
LAYERS = ["ws", "runtime", "session", "pingpong", "engine", "tools", "model", "kernels"]
# Modules beside the layer packages that belong to a layer.
MODULE_LAYER = {"metrics": "runtime", "segmenter": "session"}
LEAVES = {"types", "env", "config", "request"}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "rtts" or len(parts) < 2:
        return None
    return MODULE_LAYER.get(parts[1], parts[1])


def test_import_direction() -> None:
    bad = []
    for path in (ROOT / "rtts").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        here = _layer(".".join(rel.parts))
        if here not in LAYERS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for n in names:
                there = _layer(n)
                if there in LAYERS and LAYERS.index(there) < LAYERS.index(here):
                    bad.append(f"{rel}: imports {n}")
    assert not bad, bad
