#!/usr/bin/env bash
# How the GPU numbers in bench/results and latency_reports were produced (one H200, no internet).
# Usage on the GPU machine, from the repository root:
#   bench/run_h200.sh OUT_DIR [tests] [kernels] [layer] [sched] [fp8] [profile] [prefill] [pkernels] [codec] [pgraphs]
#                     [ttfa] [tput] [spy] [gate] [codecprec] [tm] [tmab] [soak] [tprof]
# (SCHED_CONC=1,16,64 picks the scheduler concurrencies, KERNEL_ARGS extra kernel-bench flags; RTTS_CODEC_GRAPHS=0 /
# RTTS_PREFILL_GRAPHS=0 serve the ttfa step without codec / turn-prefill CUDA graphs, TTFA_NAME names its report,
# TTFA_CONC / TTFA_MAX_RUNNING / TTFA_PREFILL_ROWS its concurrencies, server slots and prompts per prefill batch,
# TTFA_FP8=1 serves FP8 linears; tput: `rtts serve --fp8` with 64 slots and the probe's throughput mode at
# TPUT_CONC (default 1,16,32,64), a 10 s stored voice, TPUT_TURNS turns of TPUT_FRAMES frames; CODEC_MODES /
# CODEC_CONC the codec step's runs; soak: clients/soak.py against `rtts serve --fp8` with 64 slots, SOAK_CONC (64)
# clients for SOAK_WARMUP (60) s of warm-up then SOAK_SECONDS (600) s measured, idle RSS growth bound SOAK_RSS_MB (256);
# it runs longer than one device call may (10 min): start it detached,
#   nohup bench/run_h200.sh /tmp/soak soak > /tmp/soak.log 2>&1 &
# and copy /tmp/soak into the call's $OUT about 14 minutes later; its report goes to bench/results/soak/)
# Python packages the image lacks travel as wheels in .whl/ (bench/fetch_wheels.sh fetches them, here).
# Pass RTTS_COMMIT=<sha> from the machine that sent the tree: the copy on the GPU machine may carry a stale .git.
set -u
OUT=${1:?output dir}; shift
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 RTTS_HOME=/tmp/rh
wait_healthy() {  # PORT SECONDS: until the server on PORT answers /v1/health
  for _ in $(seq 1 "$2"); do
    python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/v1/health', timeout=1)" 2>/dev/null && return
    sleep 1
  done
}
for step in "$@"; do
  case $step in
    tests) timeout 420 python3 -m pytest -q -m gpu tests/test_kernels.py tests/test_attention_kernels.py tests/test_gemm_plan.py tests/test_layer_kernels.py tests/test_dequant.py tests/test_gpu.py tests/test_quant.py tests/test_codec_ops.py tests/test_demo_voice_fp8.py \
             -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/tests.log" | grep -v "driver.pyx\|Exception ignored\|NoneType" \
             | tail -25 ;;  # the whole log stays under OUT: a device call returns only its output's tail
    tm) timeout 150 python3 -m pytest -q -m gpu tests/test_kernels.py -k "token_major or pdl_chain or rounds_like" \
          -p no:cacheprovider --tb=short 2>&1 | tee "$OUT/tm-tests.log" | tail -6  # the token-major GEMM: its tests, then the
        for v in 0 1; do                               # kernel bench with it off (RTTS_GEMM_TM=0) and forced (1)
          RTTS_GEMM_TM=$v timeout 100 python3 -m rtts.bench kernels --sections gemm,mlp --m 17,32,64 --out "$OUT/tm$v" \
            2>&1 | grep "^|"
        done ;;
    tmab) timeout 240 python3 bench/probes/gemm_tm_ablation.py "$OUT" 32,64 > "$OUT/tm-ablation.log" 2>&1  # where the
          grep " us$" "$OUT/tm-ablation.log" ;;                 # token-major GEMM's time goes (variants, PDL chain)
    kernels) timeout 300 python3 -m rtts.bench kernels --out "$OUT" ${KERNEL_ARGS:-} 2>&1 | tail -40 ;;
    sched) timeout 200 python3 -m rtts.bench scheduler --preset s2-pro --concurrency ${SCHED_CONC:-1,4,16,64} --codec none \
             --seconds 5 --warmup 1.5 --out "$OUT" 2>&1 | grep -v "^Point" | tail -8 ;;
    fp8) timeout 200 python3 -m rtts.bench scheduler --preset s2-pro --fp8 --concurrency 1,16,64 --codec none \
           --seconds 5 --warmup 1.5 --out "$OUT" 2>&1 | grep -v "^Point" | tail -8 ;;
    layer) timeout 120 python3 -m rtts.bench kernels --sections layer --out "$OUT" 2>&1 | grep "^|" ;;
    profile) timeout 200 python3 bench/probes/step_profile.py "$OUT" --fp8 --batches 1,16,64 2>&1 | grep -E "^B=" ;;
    prefill) timeout 200 python3 bench/probes/prefill_time.py "$OUT" --profile > "$OUT/prefill-time.log" 2>&1
             grep -E "^(1 x|8 x|fresh|profile)" "$OUT/prefill-time.log" ;;
    pkernels) timeout 150 python3 -m rtts.bench kernels --sections prefill --out "$OUT" 2>&1 | grep "^|" ;;
    codecprec) timeout 300 python3 bench/probes/codec_precision.py "$OUT" 2>&1 | grep -v "^|" | tail -12 ;;
    codec) for g in ${CODEC_MODES:---no-codec-graphs --codec-graphs}; do  # the real codec's first-audio cost, eager and from CUDA graphs
             timeout 200 python3 -m rtts.bench scheduler --preset s2-pro --codec real --codec-concurrency ${CODEC_CONC:-1,16} $g \
               ${CODEC_ARGS:-} \
               --seconds 5 --warmup 1.5 --out "$OUT/codec$g" 2>&1 | grep -v "^Point" | tail -4
           done ;;
    pgraphs) for f in "" --fp8; do  # turn first audio with the turn prefills eager (the default replays CUDA graphs)
               timeout 200 python3 -m rtts.bench scheduler --preset s2-pro --concurrency 1,16 --codec none $f \
                 --no-prefill-graphs --seconds 5 --warmup 1.5 --out "$OUT/eager-prefill${f}" 2>&1 | grep -v "^Point" | tail -4
             done ;;
    ttfa)
      python3 -m rtts serve --random-preset s2-pro ${TTFA_FP8:+--fp8} --device cuda --max-running ${TTFA_MAX_RUNNING:-16} \
        --prefill-rows ${TTFA_PREFILL_ROWS:-16} --max-ctx 2048 --port 8090 \
        > "$OUT/serve.log" 2>&1 &
      pid=$!
      wait_healthy 8090 120
      timeout 150 python3 clients/probe.py --url ws://127.0.0.1:8090 --concurrency ${TTFA_CONC:-1,8} --rounds 5 --settle 0.5 \
        --name "${TTFA_NAME:-h200-s2pro-random-bf16}" --hardware "1x H200, ${TTFA_FP8:+FP8 linears, }bf16, rtts kernels; RTTS_CODEC_GRAPHS=${RTTS_CODEC_GRAPHS:-on} RTTS_PREFILL_GRAPHS=${RTTS_PREFILL_GRAPHS:-on} RTTS_CODEC_TF32=${RTTS_CODEC_TF32:-on}, prefill rows ${TTFA_PREFILL_ROWS:-16}" \
        --commit "${RTTS_COMMIT:-unknown}" --out "$OUT" 2>&1 | tail -6
      kill -INT $pid; sleep 3; tail -3 "$OUT/serve.log" ;;
    tput)
      python3 -m rtts serve --random-preset s2-pro --fp8 --device cuda --max-running 64 --max-ctx 2048 --port 8091 \
        ${TPUT_SERVE_ARGS:-} > "$OUT/serve-tput.log" 2>&1 &
      pid=$!
      wait_healthy 8091 180
      timeout ${TPUT_TIMEOUT:-240} python3 clients/probe.py --url ws://127.0.0.1:8091 --mode throughput \
        --concurrency ${TPUT_CONC:-1,16,32,64} --rounds ${TPUT_ROUNDS:-1} --turns ${TPUT_TURNS:-3} --max-new-tokens ${TPUT_FRAMES:-200} \
        --stagger 1 --voice-seconds 10 --name "${TPUT_NAME:-h200-s2pro-random-fp8-throughput}" \
        --hardware "1x H200, FP8 linears, bf16, rtts kernels, 64 slots ${TPUT_SERVE_ARGS:-}" \
        --commit "${RTTS_COMMIT:-unknown}" --out "$OUT" 2>&1 | grep -v "^|" | tail -8
      kill -INT $pid; sleep 3; tail -3 "$OUT/serve-tput.log" ;;
    tprof) timeout 200 python3 bench/probes/train_step_profile.py "$OUT" --synthetic ${TPROF_SENTENCES:-20000} \
             ${TPROF_ARGS:-} > "$OUT/train-step-profile.log" 2>&1  # the demo voice's DualAR step (random codes)
           grep -E "^\{|^\| \`" "$OUT/train-step-profile.log" | head -14 ;;
    gate) timeout 200 python3 -m rtts.bench gate --make-demo /tmp/gate --device cuda > "$OUT/gate.json" 2> "$OUT/gate.log"
          echo "gate exit $?"; tail -3 "$OUT/gate.log" ;;  # the FP8 correctness gate on a model with far-from-flat logits
    spy)  # the tput server under py-spy (wheel in .whl/): SPY_CONC sessions twice, sampled with --gil (only the thread
          # holding the GIL: who keeps the others waiting) and then --idle (every thread, waiting ones too)
      python3 -m rtts serve --random-preset s2-pro --fp8 --device cuda --max-running 64 --max-ctx 2048 --port 8093 \
        ${TPUT_SERVE_ARGS:-} > "$OUT/serve-spy.log" 2>&1 &
      pid=$!
      wait_healthy 8093 180
      for mode in gil idle; do
        (sleep ${SPY_DELAY:-3}; /tmp/site/bin/py-spy record --pid $pid --$mode --threads --duration ${SPY_SECONDS:-8} \
           --rate 200 --format raw --output "$OUT/spy-$mode.txt" --nonblocking > "$OUT/spy-$mode.log" 2>&1) &
        spy=$!
        timeout 120 python3 clients/probe.py --url ws://127.0.0.1:8093 --mode throughput --concurrency ${SPY_CONC:-64} \
          --rounds 1 --turns 3 --max-new-tokens 200 --stagger 1 --voice-seconds 10 --name "spy-$mode" \
          --commit "${RTTS_COMMIT:-unknown}" --out "$OUT/spy" 2>&1 | grep "^c="
        wait $spy; tail -2 "$OUT/spy-$mode.log"
      done
      kill -INT $pid; sleep 3; tail -3 "$OUT/serve-spy.log" ;;
    soak)
      python3 -m rtts serve --random-preset s2-pro --fp8 --device cuda --max-running 64 --max-ctx 2048 --port 8092 \
        --voices-dir /tmp/rh/soak-voices > "$OUT/serve-soak.log" 2>&1 &
      pid=$!
      wait_healthy 8092 180
      timeout $(( ${SOAK_WARMUP:-60} + ${SOAK_SECONDS:-600} + 300 )) python3 clients/soak.py --url http://127.0.0.1:8092 \
        --concurrency ${SOAK_CONC:-64} --warmup ${SOAK_WARMUP:-60} --duration ${SOAK_SECONDS:-600} --max-new-tokens 200 \
        --server-pid $pid --server-log "$OUT/serve-soak.log" --rss-growth-mb ${SOAK_RSS_MB:-256} \
        --name "${SOAK_NAME:-h200-s2pro-random-fp8-soak-c64}" --hardware "1x H200, FP8 linears, bf16, 64 slots" \
        --commit "${RTTS_COMMIT:-unknown}" --out "$OUT" 2>&1 | tail -30
      kill -INT $pid; sleep 3; tail -3 "$OUT/serve-soak.log" ;;
  esac
done
