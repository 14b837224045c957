#!/bin/bash
# usage: gateway-per-request.sh TREE TAG MODEL PROTO(grpc|http-binary) N C
# The gateway (from TREE) under callgrind in front of one ONNX service on
# /tmp/bench-models/onnx_repo, counters zeroed after 300 warm-up requests and dumped after N
# more, driven by this worktree's `python -m load` at concurrency C (the mlp with perf_analyzer's
# input data). Copied from ../2026-11-26-s5-mlppath/ (own port base and output folder); adapted from ../2026-11-26-h2speed/gateway-per-request.sh (callgrind mode, model
# as a parameter). Instructions per request: ../2026-11-26-refactor/per-request.sh N OUT
set -e
TREE=$1; TAG=$2; MODEL=$3; PROTO=$4; N=${5:-2000}; C=${6:-8}
HERE=$(cd $(dirname $0)/../../.. && pwd)
B=${CG_PORT_BASE:-25000}; SG=$((B+101)); SH=$((B+100)); GG=$((B+201)); GH=$((B+200))
OUT=/tmp/gw-per-request-gwtrim/$TAG-$MODEL-$PROTO-c$C; mkdir -p $OUT; rm -f $OUT/*
PY=/root/.pyenv/versions/3.11.7/bin/python3
LOAD="$PY -m load --http 127.0.0.1:$GH --grpc 127.0.0.1:$GG -m $MODEL --protocol $PROTO -c $C --quiet --input-file /tmp/bench-models/perf_data/$MODEL.json"
cd $TREE
$PY -m meshserve service onnx --repository /tmp/bench-models/onnx_repo --grpc-port $SG --http-port $SH > $OUT/svc.log 2>&1 &
SVC=$!
until curl -sf localhost:$SH/v2/health/ready >/dev/null; do sleep 0.3; done
valgrind --tool=callgrind --callgrind-out-file=$OUT/cg.out $PY -m meshserve gateway --grpc-port $GG --http-port $GH \
  --upstream 127.0.0.1:$SG > $OUT/gw.log 2>&1 &
GW=$!
until curl -sf localhost:$GH/v2/health/ready >/dev/null; do sleep 0.5; done
cd $HERE
$LOAD -n 300 >/dev/null
callgrind_control -z $GW >/dev/null
$LOAD -n $N --warmup 0 --json $OUT/load.json >/dev/null
callgrind_control -d $GW >/dev/null
curl -s localhost:$GH/metrics | grep -E "^meshserve_gateway_(merged|coalesce)" > $OUT/coalesce.txt || true
kill $GW; wait $GW || true
kill $SVC; wait $SVC || true
echo "$OUT"
