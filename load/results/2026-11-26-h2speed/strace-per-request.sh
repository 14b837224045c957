#!/bin/bash
# usage: strace-per-request.sh TREE TAG PROTO(grpc|http-binary) N C   syscalls of the gateway process
# (all threads, strace -c -f) per request over N requests at concurrency C, after 300 warm-up
set -e
TREE=$1; TAG=$2; PROTO=$3; N=${4:-3000}; C=${5:-1}
B=${ST_PORT_BASE:-23500}; SG=$((B+101)); SH=$((B+100)); GG=$((B+201)); GH=$((B+200))
OUT=/tmp/st/$TAG-$PROTO-c$C; mkdir -p $OUT; rm -f $OUT/*
cd $TREE
python3 -m meshserve service onnx --repository /tmp/bench-models/onnx_repo --grpc-port $SG --http-port $SH > $OUT/svc.log 2>&1 &
SVC=$!
until curl -sf localhost:$SH/v2/health/ready >/dev/null; do sleep 0.3; done
python3 -m meshserve gateway --grpc-port $GG --http-port $GH --upstream 127.0.0.1:$SG > $OUT/gw.log 2>&1 &
GW=$!
until curl -sf localhost:$GH/v2/health/ready >/dev/null; do sleep 0.3; done
cd /work/main
python3 -m load --http 127.0.0.1:$GH --grpc 127.0.0.1:$GG -m add_sub --protocol $PROTO -c $C -n 300 --quiet >/dev/null
strace -c -f -p $GW -o $OUT/strace.txt &
ST=$!
sleep 1
python3 -m load --http 127.0.0.1:$GH --grpc 127.0.0.1:$GG -m add_sub --protocol $PROTO -c $C -n $N --warmup 0 --quiet --json $OUT/load.json >/dev/null
kill -INT $ST; wait $ST || true
kill $GW; wait $GW || true
kill $SVC; wait $SVC || true
awk -v n=$N 'NR>2 && $NF!="total" && $4 ~ /^[0-9]+$/ {printf "%-16s %8.2f per request\n", $NF, $4/n} NR>2 && $NF=="total" {printf "%-16s %8.2f per request\n", "TOTAL", $4/n}' $OUT/strace.txt | sort -k2 -nr | head -12
