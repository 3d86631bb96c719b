#!/usr/bin/env bash
# One host, N GPUs, no Docker: one `rtts serve` per GPU (CUDA_VISIBLE_DEVICES, one port each) behind HAProxy.
#
#     deploy/launch.sh [options] [-- rtts serve options]
#     deploy/launch.sh -- --checkpoint /models/s2-pro-fp8            # every GPU nvidia-smi lists, clients on :8080
#
# Options:
#     --gpus LIST         GPU indices, comma-separated (default: every GPU nvidia-smi lists)
#     --workers N         N workers on GPUs 0..N-1 (instead of --gpus; with --device cpu, N CPU workers)
#     --device D          cuda (default) or cpu
#     --bind ADDR:PORT    where clients connect, HAProxy's frontend (default *:8080)
#     --stats ADDR:PORT   HAProxy's status page /stats and its Prometheus metrics /metrics (default 127.0.0.1:8404)
#     --base-port P       worker i listens on 127.0.0.1:P+i (default 8081)
#     --drain-grace S     what each worker's drain allows open sessions (default 30 s)
#     --run-dir DIR       logs, pid files and the rendered HAProxy configuration (default ./rtts-run)
# Environment: RTTS (the rtts command, default "rtts"), HAPROXY (default "haproxy").
#
# Stop with SIGTERM or Ctrl-C: every worker drains (its sessions finish, new ones are refused and retried by HAProxy on
# the others while they can), then HAProxy stops; a second signal ends the drains at once. A worker that exits on its
# own (it failed, or was drained by `kill -TERM $(cat DIR/worker-I.pid)`) is started again: draining workers one at a
# time restarts the fleet without dropping a session.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
gpus="" workers="" device="cuda" bind="*:8080" stats="127.0.0.1:8404" base_port=8081 drain_grace=30 run_dir="rtts-run"
die() { echo "launch.sh: $*" >&2; exit 2; }
# `wait -n -p` (which process ended) came with bash 5.1 (Debian 12, Ubuntu 22.04).
(( BASH_VERSINFO[0] > 5 || (BASH_VERSINFO[0] == 5 && BASH_VERSINFO[1] >= 1) )) || die "needs bash 5.1 or later"
while [ "$#" -gt 0 ]; do
    case "$1" in
        --gpus) gpus="$2"; shift 2 ;;
        --workers) workers="$2"; shift 2 ;;
        --device) device="$2"; shift 2 ;;
        --bind) bind="$2"; shift 2 ;;
        --stats) stats="$2"; shift 2 ;;
        --base-port) base_port="$2"; shift 2 ;;
        --drain-grace) drain_grace="$2"; shift 2 ;;
        --run-dir) run_dir="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown option $1 (rtts serve options go after --)" ;;
    esac
done
serve_args=("$@")
read -r -a rtts <<<"${RTTS:-rtts}"
haproxy="${HAPROXY:-haproxy}"

if [ -n "$workers" ]; then
    [[ "$workers" =~ ^[1-9][0-9]*$ ]] || die "--workers wants a positive number"
    gpus="$(seq -s, 0 $((workers - 1)))"
elif [ -z "$gpus" ]; then
    [ "$device" = cuda ] || die "--device $device: say how many workers with --workers"
    gpus="$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)" || die "nvidia-smi failed: give --gpus"
fi
IFS=, read -r -a gpu_list <<<"$gpus"
[ "${#gpu_list[@]}" -gt 0 ] || die "no GPU to run on"

mkdir -p "$run_dir"
run_dir="$(cd "$run_dir" && pwd)"
log() { echo "$(date '+%F %T') launch.sh: $*"; }

addrs=()
for i in "${!gpu_list[@]}"; do addrs+=("127.0.0.1:$((base_port + i))"); done
"$here/render-haproxy.sh" "${addrs[@]}" >"$run_dir/haproxy.cfg"
export RTTS_LB_BIND="$bind" RTTS_LB_STATS="$stats"
"$haproxy" -c -q -f "$run_dir/haproxy.cfg" || die "HAProxy refused $run_dir/haproxy.cfg"

declare -A worker_of=()  # pid -> worker index
declare -a pids=()
haproxy_pid=""

start_worker() {
    local i="$1"
    # setsid: a terminal's Ctrl-C reaches this script only, which drains the workers instead of stopping them.
    CUDA_VISIBLE_DEVICES="${gpu_list[$i]}" setsid "${rtts[@]}" serve --host 127.0.0.1 --port "$((base_port + i))" \
        --device "$device" --drain-grace "$drain_grace" "${serve_args[@]}" >>"$run_dir/worker-$i.log" 2>&1 &
    pids[i]=$!
    worker_of[$!]="$i"
    echo "$!" >"$run_dir/worker-$i.pid"
    log "worker $i (GPU ${gpu_list[$i]}, 127.0.0.1:$((base_port + i)), pid $!): log $run_dir/worker-$i.log"
}

start_haproxy() {
    setsid "$haproxy" -W -db -f "$run_dir/haproxy.cfg" >>"$run_dir/haproxy.log" 2>&1 &
    haproxy_pid=$!
    echo "$haproxy_pid" >"$run_dir/haproxy.pid"
    log "HAProxy on $bind (status: http://$stats/stats), pid $haproxy_pid: log $run_dir/haproxy.log"
}

stopping=0
on_signal() {
    if [ "$stopping" = 0 ]; then
        stopping=1
        log "stopping: the workers drain (up to ${drain_grace} s), then HAProxy stops"
    else
        log "stopping now: the drains end"
    fi
    kill -TERM "${pids[@]}" 2>/dev/null || true
}
trap on_signal TERM INT

for i in "${!gpu_list[@]}"; do start_worker "$i"; done
start_haproxy

# Supervise: whatever exits while running is started again (after a pause, so that a worker failing at start-up
# does not spin).
while [ "$stopping" = 0 ]; do
    exited=""
    set +e
    wait -n -p exited "${pids[@]}" "$haproxy_pid"
    status=$?
    set -e
    [ "$stopping" = 0 ] || break
    [ -n "$exited" ] || continue  # (a signal interrupted the wait)
    if [ "$exited" = "$haproxy_pid" ]; then
        log "HAProxy exited (status $status): starting it again"
        sleep 1
        start_haproxy
    else
        i="${worker_of[$exited]}"
        unset "worker_of[$exited]"
        log "worker $i exited (status $status): starting it again"
        sleep 2
        [ "$stopping" = 0 ] && start_worker "$i"
    fi
done

# The workers drain while HAProxy still relays their sessions; it stops last.
for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null; do
        wait "$pid" 2>/dev/null && status=0 || status=$?
        kill -0 "$pid" 2>/dev/null && continue  # (a second signal interrupted the wait)
        log "worker ${worker_of[$pid]} stopped (status $status)"
    done
done
kill -TERM "$haproxy_pid" 2>/dev/null || true
wait "$haproxy_pid" 2>/dev/null || true
log "stopped"
