#!/usr/bin/env bash
# Side by side, back to back, same machine: raw onnxruntime and the real Triton (the team's
# harness, ../shared/bench), then meshserve through the gateway (`meshserve up`) and direct
# to the ONNX service, all driven by the same perf_analyzer sweep (drive.sh). Each meshserve
# cell whose run had other work above 0.1 core (drive.py's foreign CPU) is measured once more;
# at the end the 18-cell table (load/bench/ratios.py) is printed and written to side_by_side.md.
#   usage: load/bench/side_by_side.sh [RESULTS_DIR]    (or: python -m load.bench --side-by-side-once;
#   the alternating, repeated side by side of issue 36 is python -m load.bench --side-by-side, load/bench/sbs.py)
# Env: BENCH_ORT_THREADS (2: ORT intra-op threads in every server), INTERVAL (3000 ms),
#      CONC (1,8,32), BENCH_MODELS ("add_sub mlp"), SKIP (words: "anchors" to reuse earlier Triton
#      numbers, "gateway", "direct": leave that sweep out), UP_ARGS (more `meshserve up` arguments,
#      e.g. "--gateway-workers 2"), REPEAT (1: runs again per noisy cell; 0 = none), DRIVE_ARGS (more drive.py
#      arguments, e.g. "--quiet-wait 0" for a smoke run on a busy machine), PORT_BASE (19000), BENCH_DIR,
#      PROFILE (1: afterwards, py-spy and per-process CPU of every cell that misses a goal, written to
#      RESULTS_DIR/profiles/bounds.md by load/bench/profile_cells.py).
# Needs the venvs of ../shared/bench/README.md (/tmp/bench-venvs/{pa,triton}).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BENCH=${BENCH_DIR:-$ROOT/../shared/bench}
RES=${1:-/tmp/bench-results/side-by-side-$(date -u +%Y%m%dT%H%M%SZ)}
MODELS=${MODELS_DIR:-/tmp/bench-models}
PA_VENV=${PA_VENV:-/tmp/bench-venvs/pa}
export BENCH_ORT_THREADS=${BENCH_ORT_THREADS:-2}
INTERVAL=${INTERVAL:-3000}; CONC=${CONC:-1,8,32}; SKIP=${SKIP:-}; REPEAT=${REPEAT:-1}
BENCH_MODELS=${BENCH_MODELS:-add_sub mlp}; DRIVE_ARGS=${DRIVE_ARGS:-}
PORT_BASE=${PORT_BASE:-19000}  # gateway: +0 HTTP, +1 gRPC; direct: +100, +101
GW_HTTP=$PORT_BASE; GW_GRPC=$((PORT_BASE + 1)); SVC_HTTP=$((PORT_BASE + 100)); SVC_GRPC=$((PORT_BASE + 101))
mkdir -p "$RES"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this tree's meshserve, also in the processes `meshserve up` starts
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
  for m in $BENCH_MODELS; do
    OUT="$RES/$1.jsonl" "$BENCH/drive.sh" "$2" "$3" "$m" "$1" --server-pid "$PID" --stats triton \
      --interval "$INTERVAL" --concurrency "$CONC" --input-data "$MODELS/perf_data/$m.json" $DRIVE_ARGS
  done
  for _ in $(seq 1 "$REPEAT"); do  # the cells other work disturbed, again (the quietest run counts)
    python3 -m load.bench.ratios --noisy "$RES" | while read -r label m mode c; do
      [ "$label" = "$1" ] || continue
      echo "== again, foreign CPU over 0.1 core: $label $m $mode c$c"
      OUT="$RES/$1.jsonl" "$BENCH/drive.sh" "$2" "$3" "$m" "$1" --server-pid "$PID" --stats triton \
        --interval "$INTERVAL" --concurrency "$c" --modes "$mode" --input-data "$MODELS/perf_data/$m.json" $DRIVE_ARGS
    done
  done
}

cd "$ROOT"
if [[ " $SKIP " != *" gateway "* ]]; then
  echo "== meshserve through the gateway (meshserve up: gateway + onnx service) ${UP_ARGS:-}"
  # shellcheck disable=SC2086  # UP_ARGS: several words
  python3 -m meshserve up --repository "$MODELS/onnx_repo" --http-port "$GW_HTTP" --grpc-port "$GW_GRPC" \
    ${UP_ARGS:-} > "$RES/meshserve-up.log" 2>&1 &
  PID=$!
  wait_ready "http://127.0.0.1:$GW_HTTP/v2/health/ready"
  sweep meshserve-gateway "127.0.0.1:$GW_HTTP" "127.0.0.1:$GW_GRPC"
  curl -s "http://127.0.0.1:$GW_HTTP/v2/models/stats" > "$RES/meshserve_stats_final.json" || true
  stop
fi

if [[ " $SKIP " != *" direct "* ]]; then
  echo "== meshserve direct to the ONNX service (no gateway)"
  python3 -m meshserve service onnx --repository "$MODELS/onnx_repo" --grpc-port "$SVC_GRPC" --http-port "$SVC_HTTP" \
    --log-level WARNING > "$RES/meshserve-service.log" 2>&1 &
  PID=$!
  wait_ready "http://127.0.0.1:$SVC_HTTP/v2/health/ready"
  sweep meshserve-direct "127.0.0.1:$SVC_HTTP" "127.0.0.1:$SVC_GRPC"
  stop
fi

"$PA_VENV/bin/python" "$BENCH/report.py" "$RES"/*.jsonl > "$RES/tables.md"
python3 -m load.bench.ratios "$RES" | tee "$RES/side_by_side.md"
echo "== done: $RES/side_by_side.md (the harness's own tables: $RES/tables.md)"
if [ "${PROFILE:-0}" = 1 ]; then
  echo "== what bounds each missed cell (py-spy): load/bench/profile_cells.py"
  python3 -m load.bench.profile_cells "$RES" --interval "$INTERVAL" --port-base "$PORT_BASE"
fi
