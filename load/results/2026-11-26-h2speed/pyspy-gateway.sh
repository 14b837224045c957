#!/bin/bash
# usage: pyspy-gateway.sh TREE TAG PROTO N C   py-spy (collapsed stacks, 2000 Hz) of the gateway over N requests at c C
set -e
TREE=$1; TAG=$2; PROTO=$3; N=${4:-20000}; C=${5:-1}
B=${ST_PORT_BASE:-23600}; SG=$((B+101)); SH=$((B+100)); GG=$((B+201)); GH=$((B+200))
OUT=/tmp/spy/$TAG-$PROTO-c$C; mkdir -p $OUT; rm -f $OUT/*
cd $TREE
python3 -m meshserve service onnx --repository /tmp/bench-models/onnx_repo --grpc-port $SG --http-port $SH > $OUT/svc.log 2>&1 &
SVC=$!
until curl -sf localhost:$SH/v2/health/ready >/dev/null; do sleep 0.3; done
/root/.pyenv/versions/3.11.7/bin/python3 -m meshserve gateway --grpc-port $GG --http-port $GH --upstream 127.0.0.1:$SG > $OUT/gw.log 2>&1 &
GW=$!
until curl -sf localhost:$GH/v2/health/ready >/dev/null; do sleep 0.3; done
cd /work/main
python3 -m load --http 127.0.0.1:$GH --grpc 127.0.0.1:$GG -m add_sub --protocol $PROTO -c $C -n 300 --quiet >/dev/null
py-spy record -r 2000 -f raw -o $OUT/spy.txt -p $GW --nonblocking > $OUT/spy.log 2>&1 &
SP=$!
sleep 1
python3 -m load --http 127.0.0.1:$GH --grpc 127.0.0.1:$GG -m add_sub --protocol $PROTO -c $C -n $N --warmup 0 --quiet --json $OUT/load.json >/dev/null
kill -INT $SP; wait $SP || true
kill $GW; wait $GW || true
kill $SVC; wait $SVC || true
