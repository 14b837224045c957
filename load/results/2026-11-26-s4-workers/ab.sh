#!/usr/bin/env bash
# 1 vs 2 gateway workers, alternating A/B/A/B (the machine is shared): one ONNX service
# (/tmp/bench-models/onnx_repo, BENCH_ORT_THREADS=2) behind two gateways started side by side,
# `--workers 1` on PORT_BASE (+0 HTTP, +1 gRPC) and `--workers 2` on PORT_BASE+10; the service on
# PORT_BASE+100. perf_analyzer through ../shared/bench/drive.sh; results JSON lines in $RES.
#   usage: ab.sh [RESULTS_DIR]   env: ROUNDS (3), INTERVAL (2000), CONC (8,32), MODES (http,grpc),
#          BENCH_MODELS ("add_sub mlp"), PORT_BASE (24000)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
BENCH=${BENCH_DIR:-/work/shared/bench}
RES=${1:-/tmp/bench-results/s4-workers-$(date -u +%Y%m%dT%H%M%SZ)}
MODELS=${MODELS_DIR:-/tmp/bench-models}
ROUNDS=${ROUNDS:-3}; INTERVAL=${INTERVAL:-2000}; CONC=${CONC:-8,32}; MODES=${MODES:-http,grpc}
BENCH_MODELS=${BENCH_MODELS:-add_sub mlp}; PORT_BASE=${PORT_BASE:-24000}
export BENCH_ORT_THREADS=2 PYTHONPATH="$ROOT"
mkdir -p "$RES"; cd "$ROOT"
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait' EXIT
ready() { for _ in $(seq 1 120); do curl -sf -o /dev/null "http://127.0.0.1:$1/v2/health/ready" && return 0; sleep 1; done; return 1; }
python3 -m meshserve service onnx --repository "$MODELS/onnx_repo" --grpc-port $((PORT_BASE + 101)) \
  --http-port $((PORT_BASE + 100)) --log-level WARNING > "$RES/service.log" 2>&1 &
PIDS+=($!); ready $((PORT_BASE + 100))
declare -A GW
for w in 1 2; do
  off=$(( (w - 1) * 10 ))
  python3 -m meshserve gateway --workers "$w" --http-port $((PORT_BASE + off)) --grpc-port $((PORT_BASE + off + 1)) \
    --upstream "127.0.0.1:$((PORT_BASE + 101))" --log-level WARNING > "$RES/gateway-w$w.log" 2>&1 &
  GW[$w]=$!; PIDS+=($!); ready $((PORT_BASE + off))
done
for r in $(seq 1 "$ROUNDS"); do
  for w in 1 2; do
    off=$(( (w - 1) * 10 ))
    for m in $BENCH_MODELS; do
      echo "== round $r workers $w $m (load $(cut -d' ' -f1-3 /proc/loadavg))"
      OUT="$RES/results.jsonl" "$BENCH/drive.sh" "127.0.0.1:$((PORT_BASE + off))" "127.0.0.1:$((PORT_BASE + off + 1))" \
        "$m" "w$w-r$r" --server-pid "${GW[$w]}" --stats triton --interval "$INTERVAL" --concurrency "$CONC" \
        --modes "$MODES" --input-data "$MODELS/perf_data/$m.json" --quiet-wait 0 > "$RES/drive-w$w-r$r-$m.log" 2>&1
      echo "   load after: $(cut -d' ' -f1-3 /proc/loadavg)"
      # which worker served (cumulative per worker; requests of every mode so far)
      curl -s "http://127.0.0.1:$((PORT_BASE + off))/metrics" | grep '^meshserve_gateway_requests_total' \
        > "$RES/metrics-w$w-r$r-$m.txt" || true
    done
  done
done
