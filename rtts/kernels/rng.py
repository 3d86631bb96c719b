"""Counter-based random numbers for the exponential-race draw: per stream, on the device, no host sync.

A batched step serves many streams, each with its own seed. A shared torch generator would make a stream's samples
depend on who else is in the batch; instead every noise value is a pure function of
(stream seed, stream step counter, draw id, vocabulary index), computed with integer tensor ops. The same seed gives
the same audio at any concurrency, and the ops are CUDA-graph friendly (no host reads, fixed shapes).

The hash is a 32-bit integer mixer applied in int64 arithmetic; every product stays below 2**63 so no step relies on
signed overflow.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_MUL = 0x045D9F3B  # < 2**27: (2**32) * _MUL < 2**63
_GOLD = 0x9E3779B1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32 -> 32 bit mixer on int64 tensors holding values in [0, 2**32)."""
    x = ((x >> 16) ^ x) * _MUL & _M32
    x = ((x >> 16) ^ x) * _MUL & _M32
    return (x >> 16) ^ x


def stream_keys(seeds: torch.Tensor, counters: torch.Tensor, draw: int) -> torch.Tensor:
    """Per-row 32-bit key for one draw. seeds, counters: [B] int64 -> [B] int64."""
    k = _mix((seeds & _M32) ^ (draw * 0x27D4EB2F & _M32))
    k = _mix(k ^ ((seeds >> 32) & _M32))
    k = _mix(k ^ (counters & _M32))
    return _mix(k ^ ((counters >> 32) & _M32))


def exponential_noise(seeds: torch.Tensor, counters: torch.Tensor, draw: int, ids: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise q for the race `argmax(p / q)`.

    seeds, counters: [B] int64; ids: [n] int64 (vocabulary indices the draw ranges over) -> [B, n] float32.
    The value for (row, id) does not depend on which other ids are asked for, so drawing over a restricted candidate
    set gives the same numbers as drawing over the full vocabulary at those indices.
    """
    keys = stream_keys(seeds, counters, draw)  # [B]
    h = _mix(keys[:, None] ^ ((ids[None, :] & _M32) * 0x61C8864F & _M32))
    h = _mix(h ^ (h >> 7) ^ _GOLD)
    # 24 high bits -> u in (0, 1): never 0, so -log(u) is finite.
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)
