#!/bin/bash
# usage: [HARNESS=script.py] http_path_cg.sh TREE MODEL binary|json|json-pa [N]: instructions per request of http_path.py
# (callgrind, the run with N requests minus the run with none)
TREE=$1; MODEL=$2; KIND=$3; N=${4:-2000}
PY=/root/.pyenv/versions/3.11.7/bin/python3
H=${HARNESS:-$(dirname $(readlink -f $0))/http_path.py}
D=$(mktemp -d)
cd $TREE
for n in 0 $N; do
  PYTHONPATH=$TREE valgrind --tool=callgrind --callgrind-out-file=$D/cg.$n $PY $H $MODEL $KIND $n >/dev/null 2>&1
done
t0=$(callgrind_annotate $D/cg.0 2>/dev/null | grep "PROGRAM TOTALS" | awk '{gsub(",","",$1); print $1}')
t1=$(callgrind_annotate $D/cg.$N 2>/dev/null | grep "PROGRAM TOTALS" | awk '{gsub(",","",$1); print $1}')
echo "$TREE $MODEL $KIND: $(( (t1 - t0) / (5 * N) )) instructions per request"
rm -rf $D
