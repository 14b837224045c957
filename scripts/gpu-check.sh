#!/usr/bin/env bash
# The GPU checks in one run, on a machine with an NVIDIA GPU (CI has none: there these tests skip).
#
#   bash scripts/gpu-check.sh [WHEEL_DIR]
#
# WHEEL_DIR (optional): wheels for what the machine lacks, installed with --target into
# /tmp/gpu-check-site and put first on PYTHONPATH (for a machine that cannot reach an index; list
# in the report below). Writes gpu-check.log and junit.xml to $OUT (default ./gpu-check-out).
#
# What it runs: nvidia-smi; the versions and GPU-related capabilities of the Python stack (torch
# CUDA, cuda-python, onnxruntime's providers, tensorrt); then the tests whose GPU paths skip on a
# CPU machine: CUDA shared memory (tritonclient's cuda_shared_memory) through a gateway and
# directly at a service, KIND_GPU TorchScript / torch.export models through a real service (also
# fed from CUDA shared memory), the TorchScript sequence model on KIND_GPU, the torch adapter's
# CUDA unit test, the ONNX service's KIND_GPU (CUDA execution provider, where onnxruntime has
# it), the TensorRT service (where tensorrt imports), and KIND_GPU models' device memory counted
# and evicted under --gpu-memory-budget. The whole torchscript integration module runs too: with a
# GPU its models' KIND_AUTO resolves to KIND_GPU. With MESHSERVE_NVIDIA_CLIENT_EXAMPLES set (the
# folder of NVIDIA's src/python/examples, docs/nvidia-examples.md), NVIDIA's example clients run
# too, their two CUDA shared-memory clients among them.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/gpu-check-out}
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
export PYTHONUNBUFFERED=1
start=$(date +%s)

echo "== nvidia-smi"
nvidia-smi || echo "nvidia-smi failed"

echo "== the machine's own packages"
python3 - <<'EOF'
import importlib.metadata as md
import sys

print(sys.version.replace("\n", " "))
for name in ("torch", "cuda-bindings", "cuda-python", "cupy-cuda13x", "onnxruntime", "onnxruntime-gpu", "onnx",
             "tensorrt", "numpy", "protobuf", "grpcio", "pytest", "typing-extensions", "aiohttp", "uvloop"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"  {name} (not installed)")
EOF

if [ $# -ge 1 ] && [ -n "$1" ]; then
  echo "== installing the wheels of $1"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu-check-site "$1"/*.whl || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/gpu-check-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

echo "== GPU capabilities"
python3 - <<'EOF'
import torch

print(f"torch {torch.__version__}: cuda available {torch.cuda.is_available()}, devices {torch.cuda.device_count()}"
      + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))
from meshserve.server.shm import _cuda_runtime, cuda_devices

print(f"cuda-python runtime module: {getattr(_cuda_runtime(), '__name__', None)}; meshserve cuda_devices() = "
      f"{cuda_devices()}")
try:
    import onnxruntime as ort

    print(f"onnxruntime {ort.__version__} providers: {ort.get_available_providers()}")
except ImportError as exc:
    print(f"onnxruntime: {exc}")
try:
    import tensorrt

    print(f"tensorrt {tensorrt.__version__} imports")
except ImportError as exc:
    print(f"tensorrt does not import: {exc}")
import google.protobuf
import grpc
import tritonclient

print(f"protobuf {google.protobuf.__version__}, grpcio {grpc.__version__}, tritonclient {tritonclient.__file__}")
EOF

examples=()
if [ -n "${MESHSERVE_NVIDIA_CLIENT_EXAMPLES:-}" ]; then
  examples=(tests/e2e/test_nvidia_examples.py)
fi

echo "== tests"
timeout 450 python3 -m pytest -p no:cacheprovider -q -rA --timeout 90 --junitxml "$out/junit.xml" \
  tests/unit/server/test_shm.py \
  tests/unit/torchscript/test_torch_runtime.py \
  tests/integration/test_shared_memory.py \
  tests/integration/test_gpu.py \
  tests/integration/test_torchscript.py \
  "tests/integration/test_sequence.py::test_torchscript_sequence_model" \
  tests/integration/test_tensorrt.py \
  tests/integration/test_gpu_memory_budget.py \
  "${examples[@]}"
rc=$?
echo "== pytest exit $rc; $(($(date +%s) - start)) s in all"
nvidia-smi --query-gpu=memory.used --format=csv || true
exit $rc
