#!/bin/bash
# usage: per-request.sh MODE TREE TAG TARGET(service|gateway) MODEL PROTO(grpc|http-binary|http-json) N C
#   MODE callgrind: the measured process (the ONNX service for TARGET=service, the gateway for
#                   TARGET=gateway) under callgrind, counters zeroed after 300 warm-up requests and
#                   dumped after N more; prints user-space instructions per request (all threads)
#   MODE strace:    system calls of the measured process (all threads, strace -c -f) per request over N
#   MODE pyspy:     py-spy raw collapsed stacks (2000 Hz) of the measured process over N requests
# Adapted from ../2026-11-26-h2speed/gateway-per-request.sh (port base CG_PORT_BASE, default 26000;
# outputs under OUT_ROOT, default /tmp/httppath-per-request).
set -e
MODE=$1; TREE=$2; TAG=$3; TARGET=$4; MODEL=$5; PROTO=$6; N=${7:-3000}; C=${8:-1}
B=${CG_PORT_BASE:-26000}; SG=$((B+101)); SH=$((B+100)); GG=$((B+201)); GH=$((B+200))
OUT=${OUT_ROOT:-/tmp/httppath-per-request}/$TAG-$TARGET-$MODEL-$PROTO-c$C-$MODE; mkdir -p $OUT; rm -f $OUT/*
PY=/root/.pyenv/versions/3.11.7/bin/python3
cd $TREE
SVCARGS="-m meshserve service onnx --repository /tmp/bench-models/onnx_repo --grpc-port $SG --http-port $SH"
if [ $TARGET = service ] && [ $MODE = callgrind ]; then
  valgrind --tool=callgrind --callgrind-out-file=$OUT/cg.out $PY $SVCARGS > $OUT/svc.log 2>&1 &
else $PY $SVCARGS > $OUT/svc.log 2>&1 & fi
SVC=$!
until curl -sf localhost:$SH/v2/health/ready >/dev/null; do sleep 0.5; done
if [ $TARGET = gateway ]; then
  GWARGS="-m meshserve gateway --grpc-port $GG --http-port $GH --upstream 127.0.0.1:$SG"
  if [ $MODE = callgrind ]; then valgrind --tool=callgrind --callgrind-out-file=$OUT/cg.out $PY $GWARGS > $OUT/gw.log 2>&1 &
  else $PY $GWARGS > $OUT/gw.log 2>&1 & fi
  GW=$!; P=$GW; HP=$GH; GP=$GG
  until curl -sf localhost:$GH/v2/health/ready >/dev/null; do sleep 0.5; done
else P=$SVC; HP=$SH; GP=$SG; fi
LOAD="$PY -m load --http 127.0.0.1:$HP --grpc 127.0.0.1:$GP -m $MODEL --protocol $PROTO -c $C --quiet"
$LOAD -n 300 >/dev/null
case $MODE in
  callgrind) callgrind_control -z $P >/dev/null ;;
  strace) strace -c -f -p $P -o $OUT/strace.txt & MON=$!; sleep 1 ;;
  pyspy) py-spy record -r 2000 -f raw -o $OUT/spy.txt -p $P --nonblocking > $OUT/spy.log 2>&1 & MON=$!; sleep 1 ;;
esac
$LOAD -n $N --warmup 0 --json $OUT/load.json >/dev/null
case $MODE in
  callgrind) callgrind_control -d $P >/dev/null ;;
  *) kill -INT $MON; wait $MON || true ;;
esac
[ -n "$GW" ] && { kill $GW; wait $GW || true; }
kill $SVC; wait $SVC || true
if [ $MODE = callgrind ]; then
  a=$(callgrind_annotate --inclusive=yes "$OUT/cg.out.1" 2>/dev/null)
  tot=$(echo "$a" | grep "PROGRAM TOTALS" | awk '{gsub(",","",$1); print $1}')
  echo "$TAG $TARGET $MODEL $PROTO c$C: $((tot / N)) instructions per request ($OUT)"
elif [ $MODE = strace ]; then
  awk -v n=$N 'NR>2 && $4 ~ /^[0-9]+$/ {printf "%-16s %8.2f per request\n", ($NF=="total" ? "TOTAL" : $NF), $4/n}' \
    $OUT/strace.txt | sort -k2 -nr | head -12
else echo "$OUT"; fi
