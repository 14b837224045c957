#!/bin/bash
# usage: c1cpu.sh TREE label ; gateway+service CPU per request at c1 (add_sub gRPC and HTTP)
cd $1
CUDART=$(/tmp/bench-venvs/pa/bin/python -c 'import nvidia.cuda_runtime as m, os; print(os.path.join(list(m.__path__)[0], "lib"))')
export LD_LIBRARY_PATH=$CUDART PYTHONPATH=$1
python3 -m meshserve up --repository /tmp/bench-models/onnx_repo --http-port 19700 --grpc-port 19701 > /tmp/exp/$2.log 2>&1 &
PID=$!
for i in $(seq 150); do curl -sf localhost:19700/v2/health/ready >/dev/null && break; sleep 0.2; done
for proto in grpc http; do
 port=19701; [ $proto = http ] && port=19700
 c0=$(python3 -c "import sys; sys.path.insert(0,'/work/main'); from load.bench.procs import proc_tree_cpu_s; print(proc_tree_cpu_s($PID))")
 n0=$(curl -s localhost:19700/v2/models/add_sub/stats | python3 -c "import sys,json;print(json.load(sys.stdin)['model_stats'][0]['inference_count'])")
 /tmp/bench-venvs/pa/bin/perf_analyzer -m add_sub -u localhost:$port -i $proto --concurrency-range 1 -p 4000 2>&1 | grep -E "Throughput" | tr '\n' ' '
 c1=$(python3 -c "import sys; sys.path.insert(0,'/work/main'); from load.bench.procs import proc_tree_cpu_s; print(proc_tree_cpu_s($PID))")
 n1=$(curl -s localhost:19700/v2/models/add_sub/stats | python3 -c "import sys,json;print(json.load(sys.stdin)['model_stats'][0]['inference_count'])")
 python3 -c "print('$2 $proto c1: %.0f us CPU per inference (gateway+service), %d inferences' % (($c1-$c0)/($n1-$n0)*1e6, $n1-$n0))"
done
kill $PID; wait $PID 2>/dev/null
