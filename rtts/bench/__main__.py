"""`python -m rtts.bench {scheduler,kernels} ...`"""

from __future__ import annotations

import sys


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in ("scheduler", "kernels", "gate"):
        print("usage: python -m rtts.bench {scheduler,kernels,gate} [options]", file=sys.stderr)
        sys.exit(2)
    from rtts.bench import common

    common.COMMAND = ["python", "-m", "rtts.bench", *sys.argv[1:]]
    cmd = sys.argv.pop(1)
    if cmd == "scheduler":
        from rtts.bench.scheduler import main as run
    elif cmd == "kernels":
        from rtts.bench.kernels import main as run
    else:
        from rtts.bench.gate import main as run
    run(sys.argv[1:])


if __name__ == "__main__":
    main()
