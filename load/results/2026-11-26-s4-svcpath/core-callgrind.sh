#!/bin/bash
# usage: core-callgrind.sh TREE TAG MODEL C N: core_bench.py (this directory) under callgrind in
# TREE; prints instructions per request of the core path (no transport)
TREE=$1; TAG=$2; MODEL=$3; C=$4; N=$5
H=$(cd $(dirname $0) && pwd)
# valgrind makes every run ~1000x longer (the onnxruntime pool's wake-ups are serialized), so the
# inline bound (services/base/model.py INLINE_RUN_NS) is set to the decision a native run makes:
# add_sub's runs (5-22 us) always inline, mlp's (1-5.5 ms) never
[ $MODEL = add_sub ] && INLINE_US=${INLINE_US:-1000000000} || INLINE_US=${INLINE_US:-0}
OUT=/tmp/svc-core/$TAG-$MODEL-c$C; mkdir -p $OUT; rm -f $OUT/*
cd $TREE && MESHSERVE_INLINE_RUN_US=$INLINE_US CALLGRIND=1 PYTHONPATH=$TREE valgrind --tool=callgrind --callgrind-out-file=$OUT/cg.out \
  /root/.pyenv/versions/3.11.7/bin/python3 $H/core_bench.py $MODEL $C $N > $OUT/bench.log 2>&1
grep rows/exec $OUT/bench.log
$H/../2026-11-26-refactor/per-request.sh $N $OUT
