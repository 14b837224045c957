#!/usr/bin/env bash
# The 18-cell side by side with TLS on against TLS off, in one run (issue 34): two `meshserve up`
# on the bench models, one plaintext (label tls-off) and one with TLS on its gateway's front door
# (HTTPS and gRPC over TLS) and the hop on mutual TLS (--mesh-tls) (label tls-on), both started
# first, then every model x protocol cell driven by Triton's perf_analyzer (../shared/bench/drive.py:
# --ssl-grpc-* and --ssl-https-* for the TLS one) off then on, back to back. At the end the table
# (load/bench/tls_ratios.py) is printed and written to tls_side_by_side.md.
#   usage: load/bench/tls_side_by_side.sh [RESULTS_DIR]
# Env: INTERVAL (3000 ms), CONC (1,8,32), BENCH_MODELS ("add_sub mlp"), MODES ("grpc http http-json"),
#      DRIVE_ARGS (more drive.py arguments; a busy machine: "--quiet-wait 0"), PORT_BASE (19200),
#      BENCH_ORT_THREADS (2), PERF_ANALYZER (../shared/tools/perf_analyzer),
#      SMOKE=1: add_sub, grpc and http, c8, 300 ms windows, no waiting for a quiet machine (checks that
#      every piece works, measures nothing worth quoting; most of its time is the two `up` starting).
#      HOP_TLS (1: the tls-on `up` also runs the hop on mutual TLS, --mesh-tls; 0: the front door
#      alone on TLS, the hop signed by up's throwaway key as in tls-off: the front door's own cost).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BENCH=${BENCH_DIR:-$ROOT/../shared/bench}
PA=${PERF_ANALYZER:-$ROOT/../shared/tools/perf_analyzer}
RES=${1:-/tmp/bench-results/tls-side-by-side-$(date -u +%Y%m%dT%H%M%SZ)}
MODELS=${MODELS_DIR:-/tmp/bench-models}
export BENCH_ORT_THREADS=${BENCH_ORT_THREADS:-2}
INTERVAL=${INTERVAL:-3000}; CONC=${CONC:-1,8,32}; BENCH_MODELS=${BENCH_MODELS:-add_sub mlp}
MODES=${MODES:-grpc http http-json}; DRIVE_ARGS=${DRIVE_ARGS:-}
if [ "${SMOKE:-0}" = 1 ]; then
  INTERVAL=300; CONC=8; BENCH_MODELS=add_sub; MODES="grpc http"; DRIVE_ARGS="--quiet-wait 0 --max-trials 3 $DRIVE_ARGS"
fi
PORT_BASE=${PORT_BASE:-19200}  # off: +0 HTTP, +1 gRPC; on: +10, +11
OFF_HTTP=$PORT_BASE; OFF_GRPC=$((PORT_BASE + 1)); ON_HTTP=$((PORT_BASE + 10)); ON_GRPC=$((PORT_BASE + 11))
mkdir -p "$RES/pki"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
echo "results -> $RES (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
[ -d "$MODELS/onnx_repo" ] || python3 "$BENCH/gen_models.py" "$MODELS" >/dev/null
python3 - "$RES/pki" <<'EOF'
import sys
from pathlib import Path
from meshserve.server import certs
d = Path(sys.argv[1])
certs.authority(d, "ca").issue(d, "server", server=True)
EOF
CA=$RES/pki/ca.crt
FRONT=(--grpc-use-ssl --grpc-server-cert "$RES/pki/server.crt" --grpc-server-key "$RES/pki/server.key"
       --http-use-ssl --http-server-cert "$RES/pki/server.crt" --http-server-key "$RES/pki/server.key")

PIDS=()
stop() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done; }
trap stop EXIT
python3 -m meshserve up --repository "$MODELS/onnx_repo" --http-port "$OFF_HTTP" --grpc-port "$OFF_GRPC" \
  --metrics-port -1 --log-level WARNING > "$RES/up-off.log" 2>&1 &
OFF_PID=$!; PIDS+=("$OFF_PID")
python3 -m meshserve up --repository "$MODELS/onnx_repo" --http-port "$ON_HTTP" --grpc-port "$ON_GRPC" \
  --metrics-port -1 --log-level WARNING $([ "${HOP_TLS:-1}" = 1 ] && echo --mesh-tls) "${FRONT[@]}" > "$RES/up-on.log" 2>&1 &
ON_PID=$!; PIDS+=("$ON_PID")
ready() {  # URL [curl args]
  for _ in $(seq 1 240); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "${@:2}" "$1" || true)" = 200 ] && return 0
    sleep 0.25
  done
  echo "not ready: $1 (see $RES/up-*.log)" >&2; return 1
}
ready "http://127.0.0.1:$OFF_HTTP/v2/health/ready"
ready "https://127.0.0.1:$ON_HTTP/v2/health/ready" --cacert "$CA"
echo "both up after ${SECONDS}s"
for m in $BENCH_MODELS; do
  for mode in $MODES; do
    # shellcheck disable=SC2086  # DRIVE_ARGS: several words
    python3 "$BENCH/drive.py" --pa "$PA" --http "127.0.0.1:$OFF_HTTP" --grpc "127.0.0.1:$OFF_GRPC" --model "$m" \
      --label tls-off --out "$RES/tls-off.jsonl" --server-pid "$OFF_PID" --stats triton --modes "$mode" \
      --interval "$INTERVAL" --concurrency "$CONC" --input-data "$MODELS/perf_data/$m.json" $DRIVE_ARGS
    if [ "$mode" = grpc ]; then
      url=(--http "127.0.0.1:$ON_HTTP" --grpc "127.0.0.1:$ON_GRPC")
      ssl="--ssl-grpc-use-ssl true --ssl-grpc-root-certifications-file $CA"
    else
      url=(--http "https://127.0.0.1:$ON_HTTP" --grpc "127.0.0.1:$ON_GRPC")
      ssl="--ssl-https-verify-peer 1 --ssl-https-verify-host 2 --ssl-https-ca-certificates-file $CA"
    fi
    # (no statistics: drive.py reads them over plain HTTP; the TLS gateway's batching equals the plain one's)
    # shellcheck disable=SC2086
    python3 "$BENCH/drive.py" --pa "$PA" "${url[@]}" --model "$m" --label tls-on --out "$RES/tls-on.jsonl" \
      --server-pid "$ON_PID" --stats none --modes "$mode" --interval "$INTERVAL" --concurrency "$CONC" \
      --input-data "$MODELS/perf_data/$m.json" --extra "$ssl" $DRIVE_ARGS
  done
done
stop
trap - EXIT
python3 -m load.bench.tls_ratios "$RES" | tee "$RES/tls_side_by_side.md"
echo "== done: $RES/tls_side_by_side.md (load average now: $(cut -d' ' -f1-3 /proc/loadavg))"
