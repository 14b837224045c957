#!/bin/bash
# the cells of NOTES.md for one tree: TAG TREE
TAG=$1; TREE=$2
H=$(dirname $0)
for cell in "add_sub grpc 32" "add_sub http-binary 32" "add_sub grpc 1" "add_sub http-binary 1" "mlp grpc 32" "add_sub grpc 8" "mlp grpc 1"; do
  set -- $cell
  N=2000; [ $1 = mlp ] && N=1000
  $H/service-per-request.sh callgrind $TREE $TAG $1 $2 $N $3 >/dev/null 2>&1
  d=/tmp/svc-per-request/$TAG-$1-$2-c$3-callgrind
  rpe=$(python3 -c "import json;d=json.load(open('$d/load.json'));print(d['server_stats']['$1']['rows_per_execution'])")
  echo "$($H/../2026-11-26-refactor/per-request.sh $N $d) rows/exec $rpe"
done
