#!/usr/bin/env bash
# Side by side, back to back, same machine: raw onnxruntime and the real Triton (the team's
# harness, ../shared/bench), then meshserve through the gateway (`meshserve up`) and direct
# to the ONNX service, all driven by the same perf_analyzer sweep (drive.sh).
#   usage: load/bench/side_by_side.sh [RESULTS_DIR]
# Env: BENCH_ORT_THREADS (2: ORT intra-op threads in every server), INTERVAL (3000 ms),
#      CONC (1,8,32), SKIP ("anchors" to reuse earlier Triton numbers), BENCH_DIR.
# Needs the venvs of ../shared/bench/README.md (/tmp/bench-venvs/{pa,triton}).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BENCH=${BENCH_DIR:-$ROOT/../shared/bench}
RES=${1:-/tmp/bench-results/side-by-side-$(date -u +%Y%m%dT%H%M%SZ)}
MODELS=${MODELS_DIR:-/tmp/bench-models}
PA_VENV=${PA_VENV:-/tmp/bench-venvs/pa}
export BENCH_ORT_THREADS=${BENCH_ORT_THREADS:-2}
INTERVAL=${INTERVAL:-3000}; CONC=${CONC:-1,8,32}; SKIP=${SKIP:-}
mkdir -p "$RES"
echo "results -> $RES"

if [[ " $SKIP " != *" anchors "* ]]; then
  echo "== anchors: raw onnxruntime + Triton (../shared/bench/run_anchors.sh)"
  SKIP="mlserver probe" INTERVAL=$INTERVAL CONC=$CONC "$BENCH/run_anchors.sh" "$RES"
else
  "$PA_VENV/bin/python" "$BENCH/gen_models.py" "$MODELS" >/dev/null
fi

PID=""
stop() { if [ -n "$PID" ] && kill -0 "$PID" 2>/dev/null; then kill "$PID"; wait "$PID" 2>/dev/null || true; fi; PID=""; }
trap stop EXIT
wait_ready() {
  for _ in $(seq 1 120); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "$1" || true)" = 200 ] && return 0
    kill -0 "$PID" 2>/dev/null || { echo "meshserve died; see $RES/*.log" >&2; return 1; }
    sleep 1
  done
  return 1
}
sweep() {  # LABEL HTTP GRPC
  for m in add_sub mlp; do
    OUT="$RES/$1.jsonl" "$BENCH/drive.sh" "$2" "$3" "$m" "$1" --server-pid "$PID" --stats triton \
      --interval "$INTERVAL" --concurrency "$CONC" --input-data "$MODELS/perf_data/$m.json"
  done
}

echo "== meshserve through the gateway (meshserve up: gateway + onnx service)"
cd "$ROOT"
python3 -m meshserve up --repository "$MODELS/onnx_repo" --http-port 19000 --grpc-port 19001 \
  > "$RES/meshserve-up.log" 2>&1 &
PID=$!
wait_ready http://127.0.0.1:19000/v2/health/ready
sweep meshserve-gateway 127.0.0.1:19000 127.0.0.1:19001
curl -s http://127.0.0.1:19000/v2/models/stats > "$RES/meshserve_stats_final.json" || true
stop

echo "== meshserve direct to the ONNX service (no gateway)"
python3 -m meshserve service onnx --repository "$MODELS/onnx_repo" --grpc-port 19101 --http-port 19100 \
  --log-level WARNING > "$RES/meshserve-service.log" 2>&1 &
PID=$!
wait_ready http://127.0.0.1:19100/v2/health/ready
sweep meshserve-direct 127.0.0.1:19100 127.0.0.1:19101
stop

"$PA_VENV/bin/python" "$BENCH/report.py" "$RES"/*.jsonl > "$RES/tables.md"
echo "== done: $RES/tables.md"
