#!/bin/bash
# usage: cg.sh TREE TAG PROTO N
set -e
TREE=$1; TAG=$2; PROTO=$3; N=${4:-3000}
OUT=/tmp/cg/$TAG-$PROTO; mkdir -p $OUT; rm -f $OUT/*
cd $TREE
python3 -m meshserve service onnx --repository /tmp/bench-models/onnx_repo --grpc-port 18101 --http-port 18100 > $OUT/svc.log 2>&1 &
SVC=$!
until curl -sf localhost:18100/v2/health/ready >/dev/null; do sleep 0.3; done
valgrind --tool=callgrind --callgrind-out-file=$OUT/cg.out /root/.pyenv/versions/3.11.7/bin/python3 -m meshserve gateway --grpc-port 18201 --http-port 18200 --upstream 127.0.0.1:18101 > $OUT/gw.log 2>&1 &
GW=$!
until curl -sf localhost:18200/v2/health/ready >/dev/null; do sleep 1; done
cd /work/main
python3 -m load --http 127.0.0.1:18200 --grpc 127.0.0.1:18201 -m add_sub --protocol $PROTO -c 32 -n 300 --quiet >/dev/null
callgrind_control -z $GW >/dev/null
python3 -m load --http 127.0.0.1:18200 --grpc 127.0.0.1:18201 -m add_sub --protocol $PROTO -c 32 -n $N --warmup 0 --quiet --json $OUT/load.json >/dev/null
callgrind_control -d $GW >/dev/null
kill $GW; wait $GW || true
kill $SVC; wait $SVC || true
ls $OUT
