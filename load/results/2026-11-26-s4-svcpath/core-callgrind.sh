#!/bin/bash
# usage: core-callgrind.sh TREE TAG MODEL C N: core_bench.py (this directory) under callgrind in
# TREE; prints instructions per request of the core path (no transport)
TREE=$1; TAG=$2; MODEL=$3; C=$4; N=$5
H=$(cd $(dirname $0) && pwd)
OUT=/tmp/svc-core/$TAG-$MODEL-c$C; mkdir -p $OUT; rm -f $OUT/*
cd $TREE && MESHSERVE_INLINE_RUN_US=${INLINE_US:-5000} CALLGRIND=1 PYTHONPATH=$TREE valgrind --tool=callgrind --callgrind-out-file=$OUT/cg.out \
  /root/.pyenv/versions/3.11.7/bin/python3 $H/core_bench.py $MODEL $C $N > $OUT/bench.log 2>&1
grep rows/exec $OUT/bench.log
$H/../2026-11-26-refactor/per-request.sh $N $OUT
