#!/usr/bin/env bash
# The wheels bench/run_h200.sh installs on a GPU machine without internet (Python 3.12 there; its image has torch,
# numpy, tokenizers, safetensors, tiktoken, prometheus-client, msgpack, ...): run here, where pip reaches an index,
# from the repository root; they land in .whl/ (git-ignored), which a device call then carries.
# One version of each package, no dependencies resolved (--no-deps): the list names every one needed.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(starlette uvicorn websockets msgspec ormsgpack python-multipart soundfile soxr cffi pycparser py-spy)
PLATFORMS=()
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1 manylinux_2_31 \
         manylinux_2_34 manylinux_2_35; do
  PLATFORMS+=(--platform "${p}_x86_64")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d .whl "${PACKAGES[@]}"
ls .whl
du -sh .whl
