"""Errors raised while reading checkpoints and model inputs.

Every loader failure is a `CheckpointError` whose message names the file and, where there is one,
the tensor, so that a user with a wrong or truncated checkpoint sees what is wrong in one line.
"""

from __future__ import annotations

from pathlib import Path


class CheckpointError(Exception):
    """A checkpoint file is missing, unreadable, or disagrees with its config."""

    def __init__(self, path: str | Path, message: str, tensor: str | None = None) -> None:
        self.path = str(path)
        self.tensor = tensor
        where = f"{self.path}" + (f" [{tensor}]" if tensor else "")
        super().__init__(f"{where}: {message}")


class PromptError(ValueError):
    """A synthesis request that cannot become a prompt (empty text, too long for the context...)."""
