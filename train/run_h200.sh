#!/usr/bin/env bash
# The demo voice on one H200 (docs/demo_voice.md), in calls that each fit the device tool's limits: a command of at
# most 10 minutes, at most 8 files of at most 16 MiB back, 64 MiB carried. Run from the repository root there:
#
#   call1 OUT   flite data (all cores) -> codec (fitted to the time left) -> tokens
#               back: codec.pth, codes.part*.npy, small.tar (codec_config.json, tokens/index.json, logs)
#               carry: train/bundle                      (python -m rtts.train flite-bundle, here, first)
#   call2 OUT   DualAR (fitted to the time left) -> export
#               back: model.safetensors, codec.pth, small.tar (config, tokenizer files, README, logs)
#               carry: train/work/h200/codec train/work/h200/tokens     (train/unpack.sh put them there)
#   call3 OUT   optional: more DualAR steps from call2's weights (new optimizer, lower peak LR) -> export
#               carry: train/work/h200/codec train/work/h200/tokens.gz and, of train/work/h200/ckpt, model.safetensors
#               config.json tokenizer.json tokenizer_config.json special_tokens_map.json (not its codec.pth, the same
#               file as codec/codec.pth): with the codes gzipped (train/unpack.sh call2) they fit the 64 MiB a call takes
#
# Estimates (FLOPs counted on the h200 sizes, docs/demo_voice.md): data ~2 min on 16 cores; codec ~8 min of work at
# 25 TFLOP/s, fitted to the ~6 min call1 leaves; tokens < 0.5 min; DualAR ~4.5 min at 50 TFLOP/s, fitted to ~8.5 min.
#
# BUDGET_S (default 560) is the whole command's wall time; every stage is given what is left, and the training
# stages fit their step counts (and learning-rate schedules) to it after 30 timed steps. Each stage also saves a
# resumable state (train/work/h200/*_state.*) every few hundred steps and at its deadline.
set -uo pipefail
CALL=${1:?call1, call2 or call3}; OUT=${2:?output dir}
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
case $CALL in
  call1)
    chmod +x train/bundle/flite/flite_cmu_us_rms  # in case the copy lost its mode bits
    python3 -m rtts.train data --preset "$PRESET" --bundle train/bundle/flite --processes "$(nproc)" \
      ${SENTENCES:+--count "$SENTENCES"} 2>&1 | tee "$OUT/data.log"  # SENTENCES: other than the preset's 24,000
    [ -f $W/data/meta.json ] || exit 1
    python3 -m rtts.train codec --preset "$PRESET" --minutes "$(minutes_left 50)" 2>&1 | tee "$OUT/codec.log"
    python3 -m rtts.train tokens --preset "$PRESET" 2>&1 | tee -a "$OUT/codec.log"
    cp $W/codec/codec.pth $W/tokens/codes.part*.npy "$OUT/"
    pack codec/codec_config.json tokens/index.json codec.log.jsonl data/meta.json
    ;;
  call2|call3)
    if [ -d $W/tokens.gz ]; then  # the gzipped copy call3 carries
      mkdir -p $W/tokens && cp $W/tokens.gz/index.json $W/tokens/
      for z in $W/tokens.gz/*.npy.gz; do gunzip -c "$z" > "$W/tokens/$(basename "$z" .gz)"; done
    fi
    init=(); lr=()
    if [ "$CALL" = call3 ]; then init=(--init-weights $W/ckpt); lr=(--lr "${LR:-4e-4}"); rm -f $W/dualar_state.*; fi
    python3 -m rtts.train dualar --preset "$PRESET" "${init[@]}" "${lr[@]}" --minutes "$(minutes_left 40)" 2>&1 \
      | tee "$OUT/dualar.log"
    python3 -m rtts.train export --preset "$PRESET" --out $W/export 2>&1 | tee -a "$OUT/dualar.log"
    cp $W/export/model.safetensors $W/export/codec.pth "$OUT/"
    pack export dualar.log.jsonl
    ;;
  *) echo "unknown call $CALL" >&2; exit 2 ;;
esac
ls -la "$OUT"
echo "call took $(( $(date +%s) - T0 )) s"
