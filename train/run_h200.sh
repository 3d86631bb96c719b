#!/usr/bin/env bash
# The demo voice on one H200 (docs/demo_voice.md), in calls that each fit the device tool's limits: a command of at
# most 10 minutes, at most 8 files of at most 16 MiB back, 64 MiB carried. Run from the repository root there:
#
#   call1 OUT   flite data (all cores) -> codec (fitted to the time left) -> tokens
#               back: codec.pth, codes.part*.npy, small.tar (codec_config.json, tokens/index.json, logs)
#               carry: train/bundle                      (python -m rtts.train flite-bundle, here, first)
#   tokens OUT  flite data -> tokens with a trained codec, left on the machine for the calls that follow while it is
#               warm (its ignored outputs stay between calls; it goes back after ~30 s idle)
#               carry: train/bundle train/work/h200/codec
#   call2 OUT   DualAR (fitted to the time left) -> export; speaks and encodes the data first when the machine has no
#               tokens (a fresh machine), out of the same call's time
#               back: model.safetensors, codec.pth, small.tar (config, tokenizer files, README, logs)
#               carry: train/bundle train/work/h200/codec, or train/work/h200/tokens(.gz) instead of train/bundle
#   call3 OUT   more DualAR steps (new optimizer, lower peak LR) from this machine's last export, else from the
#               carried train/work/h200/ckpt, else from the packaged voice (rtts/demo_voice) -> export. On a fresh
#               machine carry only train/bundle: it speaks and encodes with the packaged voice's codec first (the
#               tree, the bundle and a carried checkpoint and codec would pass the 64 MiB a call takes)
#
# Measured on the H200 (bench/results/demo_voice/): data 676x real time on 16 cores (24,000 sentences, 22.7 h, in
# 121 s; all 52,311 ~4.5 min); codec 0.14 s per step of 48 x 2 s; tokens 17 s per 24,000; DualAR 0.10 s per step
# (0.29-0.44 before the stage kept attention off cuDNN).
#
# DUALAR_ARGS: more flags for the DualAR stage (e.g. "--set compile=1": its blocks through torch.compile).
# BUDGET_S (default 560) is the whole command's wall time; every stage is given what is left, and the training
# stages fit their step counts (and learning-rate schedules) to it from timed steps, refitted as those double. Each
# stage also saves a resumable state (train/work/h200/*_state.*) every few hundred steps and at its deadline.
set -uo pipefail
CALL=${1:?call1, tokens, call2 or call3}; OUT=${2:?output dir}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PRESET=${PRESET:-h200}  # micro: the same calls at toy scale on a CPU (a dry run of this script)
W=train/work/$PRESET
T0=$(date +%s)
minutes_left() {  # minutes left of BUDGET_S, less $1 seconds kept for what follows
  python3 -c "print(max(0.5, (${BUDGET_S:-560} - ($(date +%s) - $T0) - $1) / 60))"
}
pack() {  # the small files (those that exist) into OUT/small.tar; the big ones travel as files of their own
  local have=(); for f in "$@"; do [ -e "$W/$f" ] && have+=("$f"); done
  tar -C $W -cf "$OUT/small.tar" --exclude model.safetensors --exclude codec.pth "${have[@]}"
}
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
speak() {  # the flite data: the preset's sentences (all 52,311 for h200), or SENTENCES of them
  chmod +x train/bundle/flite/flite_cmu_us_rms  # in case the copy lost its mode bits
  python3 -m rtts.train data --preset "$PRESET" --bundle train/bundle/flite --processes "$(nproc)" \
    ${SENTENCES:+--count "$SENTENCES"} 2>&1 | tee "$OUT/data.log"
  [ -f $W/data/meta.json ] || exit 1
}
encode() {  # speak, then the codes of every utterance (and of the held-out ones) with the trained codec: the carried
  # train/work/<preset>/codec, else the packaged voice's (its DualAR was trained on that codec's codes)
  if [ ! -f $W/codec/codec.pth ] && [ "$PRESET" = h200 ]; then
    mkdir -p $W/codec && cp rtts/demo_voice/codec.pth rtts/demo_voice/codec_config.json $W/codec/
  fi
  speak && python3 -m rtts.train tokens --preset "$PRESET" 2>&1 | tee "$OUT/tokens.log"
}
case $CALL in
  call1)
    speak
    python3 -m rtts.train codec --preset "$PRESET" --minutes "$(minutes_left 50)" 2>&1 | tee "$OUT/codec.log"
    python3 -m rtts.train tokens --preset "$PRESET" 2>&1 | tee -a "$OUT/codec.log"
    cp $W/codec/codec.pth $W/tokens/codes.part*.npy "$OUT/"
    pack codec/codec_config.json tokens/index.json tokens/heldout codec.log.jsonl data/meta.json
    ;;
  tokens)
    encode
    pack tokens/index.json tokens/heldout data/meta.json
    ;;
  call2|call3)
    if [ -d $W/tokens.gz ] && [ ! -f $W/tokens/index.json ]; then  # the gzipped copy call3 may carry
      mkdir -p $W/tokens && cp $W/tokens.gz/index.json $W/tokens/
      [ -d $W/tokens.gz/heldout ] && cp -r $W/tokens.gz/heldout $W/tokens/
      for z in $W/tokens.gz/*.npy.gz; do gunzip -c "$z" > "$W/tokens/$(basename "$z" .gz)"; done
    fi
    if [ ! -f $W/tokens/index.json ]; then  # a fresh machine: speak and encode here, out of this call's time
      encode
    fi
    init=(); lr=()
    if [ "$CALL" = call3 ]; then
      from=$W/ckpt; [ -f $W/export/model.safetensors ] && from=$W/export  # this machine's last export, when warm
      # (read before training starts; this call's export replaces it only at the end), else the carried checkpoint,
      # else the packaged voice (a fresh machine: the repository's copy travels anyway, a carried one would not fit)
      [ -f $from/model.safetensors ] || { [ "$PRESET" = h200 ] && from=rtts/demo_voice; }
      init=(--init-weights $from); lr=(--lr "${LR:-4e-4}"); rm -f $W/dualar_state.*
    fi
    python3 -m rtts.train dualar --preset "$PRESET" "${init[@]}" "${lr[@]}" ${DUALAR_ARGS:-} --minutes "$(minutes_left 40)" 2>&1 \
      | tee "$OUT/dualar.log"
    python3 -m rtts.train export --preset "$PRESET" --out $W/export 2>&1 | tee -a "$OUT/dualar.log"
    cp $W/export/model.safetensors $W/export/codec.pth "$OUT/"
    pack export dualar.log.jsonl
    ;;
  *) echo "unknown call $CALL" >&2; exit 2 ;;
esac
ls -la "$OUT"
echo "call took $(( $(date +%s) - T0 )) s"
