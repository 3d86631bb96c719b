"""How long a full garbage collection stops a server process, before and after freeze_startup_objects: a probe.

    python bench/probes/gc_pause.py [--checkpoint DIR] [--device cpu|cuda]

Builds the server runtime as `rtts serve` does (the packaged demo voice unless --checkpoint; no warm-up), counts the
objects the cyclic collector tracks, times three full collections, freezes (rtts.startup) and times one more. A full
collection holds the GIL: every serving thread and the event loop wait for it.
"""

from __future__ import annotations

import argparse
import gc
import time

from rtts.runtime import Runtime, ServerConfig
from rtts.startup import freeze_startup_objects


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    rt = Runtime(ServerConfig(checkpoint=args.checkpoint, device=args.device, max_running=8, max_ctx=512,
                              warmup=False))
    rt.start()
    print(f"tracked objects: {len(gc.get_objects())}")
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        print(f"full collection: {1e3 * (time.perf_counter() - t):.1f} ms")
    freeze_startup_objects()
    for _ in range(3):
        t = time.perf_counter()
        gc.collect()
        ms = 1e3 * (time.perf_counter() - t)  # before get_freeze_count, which walks the frozen objects itself
        print(f"full collection after freezing {gc.get_freeze_count()} objects: {ms:.2f} ms "
              f"({len(gc.get_objects())} still tracked)")
    rt.stop()


if __name__ == "__main__":
    main()
