#!/bin/bash
# usage: http_path_cg.sh TREE MODEL binary|json|json-pa [N]: instructions per request of http_path.py
# (../2026-11-26-s4-httppath/http_path_cg.sh, with this folder's harness unless HARNESS says another)
HERE=$(dirname $(readlink -f $0))
HARNESS=${HARNESS:-$HERE/http_path.py} exec bash $HERE/../2026-11-26-s4-httppath/http_path_cg.sh "$@"
