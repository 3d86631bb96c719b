#!/usr/bin/env bash
# Put what a train/run_h200.sh call sent back (the device tool's files_at folder) where the next call carries it from
# and where `python -m rtts.train evaluate` / the package read it. Run here, from the repository root:
#   train/unpack.sh call1 FILES_AT   -> train/work/h200/codec/, train/work/h200/tokens/
#   train/unpack.sh call2 FILES_AT   -> train/work/h200/ckpt/ (the exported checkpoint; call3 the same),
#                                       train/work/h200/tokens.gz/ (what call3 carries)
set -euo pipefail
CALL=${1:?call1, call2 or call3}; FROM=${2:?folder of returned files}
PRESET=${PRESET:-h200}  # micro: the same calls at toy scale on a CPU (a dry run of this script)
W=train/work/$PRESET
mkdir -p $W
case $CALL in
  call1)
    rm -rf $W/codec $W/tokens && mkdir -p $W/codec $W/tokens
    tar -C $W -xf "$FROM/small.tar"
    cp "$FROM/codec.pth" $W/codec/
    cp "$FROM"/codes.part*.npy $W/tokens/
    ;;
  call2|call3)
    rm -rf $W/ckpt $W/export
    tar -C $W -xf "$FROM/small.tar"
    cp "$FROM/model.safetensors" "$FROM/codec.pth" $W/export/
    mv $W/export $W/ckpt
    # call3 carries these instead of tokens/ and ckpt/codec.pth (the same file as codec/codec.pth), to fit 64 MiB
    # (only when this machine holds the codes: after a `tokens` call they stayed on the GPU machine)
    if [ -f $W/tokens/index.json ]; then
      rm -rf $W/tokens.gz && mkdir -p $W/tokens.gz && cp $W/tokens/index.json $W/tokens.gz/
      [ -d $W/tokens/heldout ] && cp -r $W/tokens/heldout $W/tokens.gz/
      for f in $W/tokens/codes.part*.npy; do gzip -9 -c "$f" > "$W/tokens.gz/$(basename "$f").gz"; done
    fi
    ;;
  *) echo "unknown call $CALL" >&2; exit 2 ;;
esac
ls -R $W | head -30
