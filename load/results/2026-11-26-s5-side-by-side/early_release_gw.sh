#!/bin/bash
# usage: gw.sh label  (env passes through)
cd /work/main
CUDART=$(/tmp/bench-venvs/pa/bin/python -c 'import nvidia.cuda_runtime as m, os; print(os.path.join(list(m.__path__)[0], "lib"))')
export LD_LIBRARY_PATH=$CUDART
python3 -m meshserve up --repository /tmp/bench-models/onnx_repo --http-port 19700 --grpc-port 19701 > /tmp/exp/$1.log 2>&1 &
PID=$!
for i in $(seq 150); do curl -sf localhost:19700/v2/health/ready >/dev/null && break; sleep 0.2; done
for m in add_sub; do for c in 32 8; do
 s0=$(curl -s localhost:19700/v2/models/$m/stats | python3 -c "import sys,json;d=json.load(sys.stdin)['model_stats'][0];print(d['inference_count'],d['execution_count'])")
 /tmp/bench-venvs/pa/bin/perf_analyzer -m $m -u localhost:19701 -i grpc --concurrency-range $c -p 3000 2>&1 | grep -E "Throughput|p99 latency" | tr '\n' ' ' | sed "s/^/$1 $m c$c: /"
 s1=$(curl -s localhost:19700/v2/models/$m/stats | python3 -c "import sys,json;d=json.load(sys.stdin)['model_stats'][0];print(d['inference_count'],d['execution_count'])")
 python3 -c "a='$s0'.split();b='$s1'.split();print(' rows/exec %.1f' % ((int(b[0])-int(a[0]))/(int(b[1])-int(a[1]))))"
done; done
kill $PID; wait $PID 2>/dev/null
