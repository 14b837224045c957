#!/bin/bash
# usage: service-per-request.sh MODE TREE TAG MODEL PROTO(grpc|http-binary|grpc-stream) N C
#   The ONNX service ALONE (no gateway), driven directly by TREE's `python -m load`.
#   MODE callgrind: the service under callgrind, counters zeroed after 300 warm-up requests,
#                   dumped after N more; instructions per request: ../2026-11-26-refactor/per-request.sh N DIR
#   MODE pyspy:     py-spy raw stacks (2000 Hz, threads included) of the service over N requests
#   MODE cpu:       the service's CPU (user + system) per request over N: noisy on a shared box
# Results in /tmp/svc-per-request/TAG-MODEL-PROTO-cC-MODE. Ports CG_PORT_BASE (+100 HTTP, +101 gRPC).
set -e
MODE=$1; TREE=$2; TAG=$3; MODEL=$4; PROTO=$5; N=${6:-3000}; C=${7:-1}
B=${CG_PORT_BASE:-25000}; SG=$((B+101)); SH=$((B+100))
OUT=/tmp/svc-per-request/$TAG-$MODEL-$PROTO-c$C-$MODE; mkdir -p $OUT; rm -f $OUT/*
PY=/root/.pyenv/versions/3.11.7/bin/python3  # not the pyenv shim: valgrind must run python itself
if curl -sf localhost:$SH/v2/health/live >/dev/null; then echo "port $SH is taken: another service would be measured" >&2; exit 1; fi
cd $TREE
# under valgrind every run is ~1000x longer: the inline bound (services/base/model.py
# INLINE_RUN_NS) is set to the decision a native run makes (add_sub always inline, mlp never)
if [ $MODE = callgrind ]; then
  [ $MODEL = add_sub ] && export MESHSERVE_INLINE_RUN_US=${INLINE_US:-1000000000} || export MESHSERVE_INLINE_RUN_US=${INLINE_US:-0}
fi
LOAD="$PY -m load --http 127.0.0.1:$SH --grpc 127.0.0.1:$SG -m $MODEL --protocol $PROTO -c $C --quiet"
SVCARGS="-m meshserve service onnx --repository /tmp/bench-models/onnx_repo --grpc-port $SG --http-port $SH"
if [ $MODE = callgrind ]; then valgrind --tool=callgrind --callgrind-out-file=$OUT/cg.out $PY $SVCARGS > $OUT/svc.log 2>&1 &
else $PY $SVCARGS > $OUT/svc.log 2>&1 & fi
SVC=$!
until curl -sf localhost:$SH/v2/health/ready >/dev/null; do sleep 0.5; done
# callgrind_control reaches valgrind only while the process runs: health checks keep an idle
# service running until the command is taken (a few small requests in the window)
poke() { callgrind_control $1 $SVC >/dev/null & local C=$!; while kill -0 $C 2>/dev/null; do curl -sf localhost:$SH/v2/health/live >/dev/null; done; }
$LOAD -n 300 >/dev/null
case $MODE in
  callgrind) poke -z ;;
  cpu) T0=$(awk '{print $14+$15}' /proc/$SVC/stat) ;;
  pyspy) py-spy record -r 2000 -f raw --threads -o $OUT/spy.txt -p $SVC --nonblocking > $OUT/spy.log 2>&1 & MON=$!; sleep 1 ;;
esac
$LOAD -n $N --warmup 0 --json $OUT/load.json >/dev/null
case $MODE in
  callgrind) poke -d ;;
  cpu) echo "service CPU $(( ($(awk '{print $14+$15}' /proc/$SVC/stat) - T0) * 1000000 / $(getconf CLK_TCK) / N )) us per request" ;;
  *) kill -INT $MON; wait $MON || true ;;
esac
kill $SVC; wait $SVC || true
echo "$OUT"
