#!/bin/bash
# usage: per-request.sh N DIR...   user-space instructions per request in each run's measured
# window (cg.out.1: counters zeroed after warm-up, dumped after N requests), with and without
# the garbage collector's share
N=$1; shift
for d in "$@"; do
  a=$(callgrind_annotate --inclusive=yes "$d/cg.out.1" 2>/dev/null)
  tot=$(echo "$a" | grep "PROGRAM TOTALS" | awk '{gsub(",","",$1); print $1}')
  gc=$(echo "$a" | grep -E "gcmodule.c:gc_collect_main " | head -1 | awk '{gsub(",","",$1); print $1}')
  echo "$d: $((tot / N)) per request, of which gc $((${gc:-0} / N)); without gc $(((tot - ${gc:-0}) / N))"
done
