#!/bin/bash
# Through `meshserve up` (gateway + service), gRPC, perf_analyzer; before = /work/main, after = this
# worktree. usage: gw.sh REPO OUTFILE [REPEATS] [MODELS] [CONCURRENCIES]   (ports 21100-21101)
export LD_LIBRARY_PATH=/tmp/bench-venvs/pa/lib/python3.11/site-packages/nvidia/cuda_runtime/lib
REPO=$1; OUT=$2; REPEATS=${3:-2}; MODELS=${4:-"add_sub"}; CONCS=${5:-"8"}
HERE=$(cd "$(dirname "$0")/../../.." && pwd)
declare -A DIR=([before]=/work/main [after]=$HERE)
for s in before after; do
  (cd ${DIR[$s]} && exec python3 -m meshserve up --repository $REPO --http-port 21100 --grpc-port 21101 \
     --log-level WARNING > /tmp/cycle-up-$s.log 2>&1) &
  PID=$!
  for i in $(seq 300); do curl -sf localhost:21100/v2/health/ready >/dev/null && break; sleep 0.2; done
  for m in $MODELS; do for c in $CONCS; do for r in $(seq $REPEATS); do
    curl -s localhost:21100/v2/models/$m/stats > /tmp/cycle-stats-a.json
    line=$(/tmp/bench-venvs/pa/bin/perf_analyzer -m $m -u localhost:21101 -i grpc \
           --concurrency-range $c -p 3000 -s 30 --max-trials 8 2>&1 | grep -E "Throughput|p99 latency" | tr -s ' \n' ' ')
    curl -s localhost:21100/v2/models/$m/stats > /tmp/cycle-stats-b.json
    server=$(python3 $(dirname "$0")/stats.py /tmp/cycle-stats-a.json /tmp/cycle-stats-b.json)
    echo "gateway $s $m c$c run$r: $line| service: $server" | tee -a $OUT
  done; done; done
  kill -INT $PID; wait $PID
done
