#!/bin/sh
# Print deploy/haproxy.cfg with one `server` line per rtts worker address (HOST:PORT), for `haproxy -f`.
#     deploy/render-haproxy.sh 127.0.0.1:8081 127.0.0.1:8082 > /tmp/rtts-haproxy.cfg
set -eu
if [ "$#" -eq 0 ]; then
    echo "usage: $0 HOST:PORT [HOST:PORT ...]   (one rtts serve each)" >&2
    exit 2
fi
cat "$(dirname "$0")/haproxy.cfg"
i=0
for addr in "$@"; do
    case "$addr" in
        *:*) ;;
        *) echo "$0: $addr: expected HOST:PORT" >&2; exit 2 ;;
    esac
    echo "    server w$i $addr"
    i=$((i + 1))
done
