#!/bin/bash
# usage: server_layer.sh MODE(aiohttp|httptools|raw) PORT N  -> instructions per request of the
# server process (server_layer.py under callgrind; 640 warm-up requests, counters zeroed, N measured at c=32)
set -e
HERE=$(cd "$(dirname "$0")" && pwd)
MODE=$1; PORT=$2; N=${3:-3200}; OUT=/tmp/cg/server-layer-$MODE; mkdir -p $OUT; rm -f $OUT/*
valgrind --tool=callgrind --callgrind-out-file=$OUT/cg.out /root/.pyenv/versions/3.11.7/bin/python3 \
  $HERE/server_layer.py $MODE $PORT > $OUT/srv.log 2>&1 &
PID=$!
until grep -qs ready $OUT/srv.log; do sleep 0.5; done
python3 $HERE/server_layer_client.py $PORT 640 32 > /dev/null
callgrind_control -z $PID > /dev/null
python3 $HERE/server_layer_client.py $PORT $N 32 > /dev/null
callgrind_control -d $PID > /dev/null
kill $PID; wait $PID || true
bash $HERE/../2026-11-26-refactor/per-request.sh $N $OUT
