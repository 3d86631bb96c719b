"""Write safetensors files one tensor at a time.

`safetensors.torch.save_file` needs every tensor in memory at once; a 9 GB checkpoint written that way costs 9 GB of
RAM on top of whatever produced the tensors. The format is simple enough to stream: an 8-byte little-endian header
length, a JSON header with each tensor's dtype, shape and byte range, then the raw bytes in header order.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

_DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def write_safetensors(
    path: str | Path,
    specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
    make: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[int], None] | None = None,
) -> int:
    """Write `specs` (name, shape, dtype), in order, producing each tensor with `make(name)` only when it is written.

    Returns the number of data bytes. Peak memory = the largest single tensor.
    """
    specs = list(specs)
    header: dict[str, object] = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    for name, shape, dtype in specs:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data must start 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, shape, dtype in specs:
            t = make(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: produced {tuple(t.shape)} {t.dtype}, declared {tuple(shape)} {dtype}")
            data = t.detach().contiguous().cpu().view(torch.uint8).numpy()
            f.write(data.data)
            if on_tensor is not None:
                on_tensor(data.nbytes)
            del t, data
    return offset
