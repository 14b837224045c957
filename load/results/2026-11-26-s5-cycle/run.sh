#!/bin/bash
# Direct-to-service perf_analyzer (gRPC) runs, before/after early release, interleaved per cell.
# usage: run.sh REPO OUTFILE [REPEATS] [MODELS] [CONCURRENCIES]   (adapted from the lead's /tmp/exp/run.sh; ports 21000-21029)
# Services: before = /work/main (no early release), after = this worktree (default: on),
#           off = this worktree with MESHSERVE_EARLY_RELEASE=0 (the same code, switched off).
export LD_LIBRARY_PATH=/tmp/bench-venvs/pa/lib/python3.11/site-packages/nvidia/cuda_runtime/lib
REPO=$1; OUT=$2; REPEATS=${3:-2}; MODELS=${4:-"add_sub mlp"}; CONCS=${5:-"8 32"}
HERE=$(cd "$(dirname "$0")/../../.." && pwd)
declare -A DIR=([before]=/work/main [after]=$HERE [off]=$HERE)
declare -A PORT=([before]=21000 [after]=21010 [off]=21020)
PIDS=()
for s in before after off; do
  env=""; [ $s = off ] && env="MESHSERVE_EARLY_RELEASE=0"
  (cd ${DIR[$s]} && exec env $env python3 -m meshserve service onnx --repository $REPO \
     --grpc-port $((${PORT[$s]}+1)) --http-port ${PORT[$s]} --log-level WARNING > /tmp/cycle-$s.log 2>&1) &
  PIDS+=($!)
done
for s in before after off; do
  for i in $(seq 150); do curl -sf localhost:${PORT[$s]}/v2/health/ready && break; sleep 0.2; done
done
for m in $MODELS; do for c in $CONCS; do for r in $(seq $REPEATS); do for s in before after off; do
  curl -s localhost:${PORT[$s]}/v2/models/$m/stats > /tmp/cycle-stats-a.json
  line=$(/tmp/bench-venvs/pa/bin/perf_analyzer -m $m -u localhost:$((${PORT[$s]}+1)) -i grpc \
         --concurrency-range $c -p 3000 -s 30 --max-trials 8 2>&1 | grep -E "Throughput|p99 latency|Avg request latency" | tr -s ' \n' ' ')
  curl -s localhost:${PORT[$s]}/v2/models/$m/stats > /tmp/cycle-stats-b.json
  server=$(python3 $(dirname "$0")/stats.py /tmp/cycle-stats-a.json /tmp/cycle-stats-b.json)
  echo "$s $m c$c run$r: $line| server: $server" | tee -a $OUT
  curl -s localhost:${PORT[$s]}/metrics | grep -E "^meshserve_batch_early_release_total\{model=\"$m\"" | sed "s/^/  $s /" | tee -a $OUT
done; done; done; done
for p in "${PIDS[@]}"; do kill $p; done; wait
