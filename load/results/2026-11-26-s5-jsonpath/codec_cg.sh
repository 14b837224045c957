#!/bin/bash
# usage: codec_cg.sh TREE add_sub|mlp [N]: instructions per request of codec_cg.py under callgrind
# (the run with N requests minus the run with none, over N)
TREE=$1; MODEL=$2; N=${3:-2000}
PY=/root/.pyenv/versions/3.11.7/bin/python3
H=$(dirname $(readlink -f $0))/codec_cg.py
D=$(mktemp -d)
cd $TREE
for n in 0 $N; do
  PYTHONHASHSEED=0 PYTHONPATH=$TREE valgrind --tool=callgrind --callgrind-out-file=$D/cg.$n $PY $H $MODEL $n >/dev/null 2>&1
done
t0=$(callgrind_annotate $D/cg.0 2>/dev/null | grep "PROGRAM TOTALS" | awk '{gsub(",","",$1); print $1}')
t1=$(callgrind_annotate $D/cg.$N 2>/dev/null | grep "PROGRAM TOTALS" | awk '{gsub(",","",$1); print $1}')
echo "$TREE $MODEL: $(( (t1 - t0) / N )) instructions per request (parse_infer + render_infer_response)"
rm -rf $D
