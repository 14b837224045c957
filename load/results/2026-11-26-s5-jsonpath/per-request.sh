#!/bin/bash
# usage: per-request.sh MODE TREE TAG TARGET(service|gateway) MODEL PROTO(grpc|http-binary|http-json) N C
# ../2026-11-26-s4-httppath/per-request.sh (MODE callgrind | strace | pyspy: see there) with this
# helper's port base (CG_PORT_BASE, default 22000) and outputs under /tmp/jsonpath-per-request.
HERE=$(dirname $(readlink -f $0))
CG_PORT_BASE=${CG_PORT_BASE:-22000} OUT_ROOT=${OUT_ROOT:-/tmp/jsonpath-per-request} \
  exec bash $HERE/../2026-11-26-s4-httppath/per-request.sh "$@"
