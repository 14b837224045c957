#!/bin/bash
# usage: gateway-per-request.sh MODE TREE TAG PROTO(grpc|http-binary) N C
#   MODE callgrind: the gateway under callgrind, counters zeroed after 300 warm-up requests and
#                   dumped after N more (../2026-11-26-refactor/callgrind-one-request.sh with the
#                   client's concurrency C as a parameter); instructions per request:
#                   ../2026-11-26-refactor/per-request.sh N /tmp/gw-per-request/TAG-PROTO-cC-callgrind
#   MODE strace:    system calls of the gateway process (all threads, strace -c -f) per request over N
#   MODE pyspy:     py-spy collapsed stacks (2000 Hz) of the gateway over N requests
#   MODE cpu:       the gateway's CPU time (user + system, /proc/PID/stat) per request over N: noisy
#                   where other work shares the machine
# One ONNX service on /tmp/bench-models/onnx_repo; the load client is /work/main's `python -m load`.
set -e
MODE=$1; TREE=$2; TAG=$3; PROTO=$4; N=${5:-3000}; C=${6:-1}
B=${CG_PORT_BASE:-23000}; SG=$((B+101)); SH=$((B+100)); GG=$((B+201)); GH=$((B+200))
OUT=/tmp/gw-per-request/$TAG-$PROTO-c$C-$MODE; mkdir -p $OUT; rm -f $OUT/*
PY=/root/.pyenv/versions/3.11.7/bin/python3  # not the pyenv shim: valgrind must run python itself
LOAD="$PY -m load --http 127.0.0.1:$GH --grpc 127.0.0.1:$GG -m add_sub --protocol $PROTO -c $C --quiet"
cd $TREE
$PY -m meshserve service onnx --repository /tmp/bench-models/onnx_repo --grpc-port $SG --http-port $SH > $OUT/svc.log 2>&1 &
SVC=$!
until curl -sf localhost:$SH/v2/health/ready >/dev/null; do sleep 0.3; done
GWARGS="-m meshserve gateway --grpc-port $GG --http-port $GH --upstream 127.0.0.1:$SG"
if [ $MODE = callgrind ]; then valgrind --tool=callgrind --callgrind-out-file=$OUT/cg.out $PY $GWARGS > $OUT/gw.log 2>&1 &
else $PY $GWARGS > $OUT/gw.log 2>&1 & fi
GW=$!
until curl -sf localhost:$GH/v2/health/ready >/dev/null; do sleep 0.5; done
cd /work/main
$LOAD -n 300 >/dev/null
case $MODE in
  callgrind) callgrind_control -z $GW >/dev/null ;;
  strace) strace -c -f -p $GW -o $OUT/strace.txt & MON=$!; sleep 1 ;;
  cpu) T0=$(awk '{print $14+$15}' /proc/$GW/stat) ;;
  pyspy) py-spy record -r 2000 -f raw -o $OUT/spy.txt -p $GW --nonblocking > $OUT/spy.log 2>&1 & MON=$!; sleep 1 ;;
esac
$LOAD -n $N --warmup 0 --json $OUT/load.json >/dev/null
case $MODE in
  callgrind) callgrind_control -d $GW >/dev/null ;;
  cpu) echo "gateway CPU $(( ($(awk '{print $14+$15}' /proc/$GW/stat) - T0) * 1000000 / $(getconf CLK_TCK) / N )) us per request" ;;
  *) kill -INT $MON; wait $MON || true ;;
esac
kill $GW; wait $GW || true
kill $SVC; wait $SVC || true
if [ $MODE = strace ]; then
  awk -v n=$N 'NR>2 && $4 ~ /^[0-9]+$/ {printf "%-16s %8.2f per request\n", ($NF=="total" ? "TOTAL" : $NF), $4/n}' \
    $OUT/strace.txt | sort -k2 -nr | head -12
fi
echo "$OUT"
