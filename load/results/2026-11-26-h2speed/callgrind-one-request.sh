#!/bin/bash
# usage: callgrind-one-request.sh TREE TAG PROTO(grpc|http-binary) N [C]   (results in /tmp/cg/TAG-PROTO-cC)
# ../2026-11-26-refactor/callgrind-one-request.sh with the client's concurrency as a parameter (default 32;
# 1 for the c1 hop). Instructions per request: ../2026-11-26-refactor/per-request.sh N /tmp/cg/TAG-PROTO-cC
set -e
TREE=$1; TAG=$2; PROTO=$3; N=${4:-3000}; C=${5:-32}
B=${CG_PORT_BASE:-19000}; SG=$((B+101)); SH=$((B+100)); GG=$((B+201)); GH=$((B+200))
OUT=/tmp/cg/$TAG-$PROTO-c$C; mkdir -p $OUT; rm -f $OUT/*
cd $TREE
python3 -m meshserve service onnx --repository /tmp/bench-models/onnx_repo --grpc-port $SG --http-port $SH > $OUT/svc.log 2>&1 &
SVC=$!
until curl -sf localhost:$SH/v2/health/ready >/dev/null; do sleep 0.3; done
valgrind --tool=callgrind --callgrind-out-file=$OUT/cg.out /root/.pyenv/versions/3.11.7/bin/python3 -m meshserve gateway --grpc-port $GG --http-port $GH --upstream 127.0.0.1:$SG > $OUT/gw.log 2>&1 &
GW=$!
until curl -sf localhost:$GH/v2/health/ready >/dev/null; do sleep 1; done
cd /work/main
python3 -m load --http 127.0.0.1:$GH --grpc 127.0.0.1:$GG -m add_sub --protocol $PROTO -c $C -n 300 --quiet >/dev/null
callgrind_control -z $GW >/dev/null
python3 -m load --http 127.0.0.1:$GH --grpc 127.0.0.1:$GG -m add_sub --protocol $PROTO -c $C -n $N --warmup 0 --quiet --json $OUT/load.json >/dev/null
callgrind_control -d $GW >/dev/null
kill $GW; wait $GW || true
kill $SVC; wait $SVC || true
ls $OUT
