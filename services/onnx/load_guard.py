"""A memory bound on loading an ONNX model that came in a load request (an upload).

Measured (onnxruntime 1.x, 2-core VM): a 251-byte graph of two ``ConstantOfShape`` nodes of
10^8 floats added together takes the process from 46 MiB to 1963 MiB (peak RSS) in
``InferenceSession()``: graph optimization folds the constants, 400 MB per node. What was tried:

- ``ORT_DISABLE_ALL`` (no constant folding) and ``session.disable_prepacking``: the load stays
  at 56 MiB, but the same memory is then allocated by every inference; and a config may set
  the level back. No onnxruntime option bounds what folding allocates.
- ``RLIMIT_AS`` around the load in-process: cannot be lifted once set for the whole service;
  and under the limit onnxruntime catches ``std::bad_alloc`` in constant folding, logs
  "Exception during constant folding ... bad_alloc. Skipping constant folding for this node"
  and *succeeds*, so the service would then hold the model unfolded.
- **What holds**: create the session once in a child process, with the same session options,
  under ``RLIMIT_AS`` = its address space after importing onnxruntime + the bound + a slack for
  the file's own mapping and thread stacks, and read its verdict: refused when the session
  could not be made for lack of memory, when onnxruntime logged a ``bad_alloc`` (folding gave
  up), or when its peak RSS grew by more than the bound. The bomb is refused in ~0.5 s with
  the child at most bound + slack; the service itself never touches the graph. A model that
  passes is then loaded by the service as usual (the child's cost: ~0.3 s per uploaded model).

Only uploads are checked: the repository's own models are the operator's (docs/security.md).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from meshserve._proto import model_config_pb2 as mc
from meshserve.protocol.errors import InferError

# address space the child may take beyond the bound: the model file's own mapping, onnxruntime's
# thread stacks and arenas' first blocks (a 64 MiB model file loads in a child with bound 0 + this)
SLACK_BYTES = 256 << 20
TIMEOUT_S = 300.0
_ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds services/ and meshserve/


def check(model_file: Path, config: mc.ModelConfig, max_bytes: int) -> None:
    """Refuse (InferError.invalid) a model whose onnxruntime session takes more than ``max_bytes``
    of memory to create, measured in a child process that cannot take more than
    ``max_bytes`` + SLACK_BYTES. Other load failures are left to the service's own load."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
    try:
        done = subprocess.run([sys.executable, "-m", "services.onnx.load_guard", str(model_file), str(max_bytes)],
                              input=config.SerializeToString(), capture_output=True, timeout=TIMEOUT_S, env=env,
                              check=False)
    except subprocess.TimeoutExpired:
        raise InferError.invalid(f"failed to load '{config.name}': the model did not load within {TIMEOUT_S:.0f} s "
                                 "under the memory bound (--max-model-load-bytes)") from None
    verdict: dict[str, object] = {}
    lines = done.stdout.decode("utf-8", "replace").strip().splitlines()
    if lines:
        try:
            verdict = json.loads(lines[-1])
        except ValueError:
            verdict = {}
    if over_bound(done.returncode, verdict, done.stderr, max_bytes):
        raise InferError.invalid(f"failed to load '{config.name}': loading the model needs more than "
                                 f"{max_bytes} bytes of memory (the bound on an uploaded model's load, "
                                 "--max-model-load-bytes)")


def over_bound(returncode: int, verdict: dict[str, object], stderr: bytes, max_bytes: int) -> bool:
    """The child's verdict: it ran out of its address space, onnxruntime gave up on an
    allocation (it logs std::bad_alloc and carries on without folding), or its peak grew past
    the bound. A child that died without a verdict (killed) counts as over too."""
    if b"bad_alloc" in stderr or b"MemoryError" in stderr:
        return True
    if not verdict:
        return returncode != 0
    error = str(verdict.get("error") or "")
    grown = verdict.get("grown")
    return ("bad_alloc" in error or "MemoryError" in error or "Failed to allocate" in error
            or (isinstance(grown, int) and grown > max_bytes))


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(model_file: str, max_bytes: int) -> None:
    import onnxruntime as ort

    from services.onnx.runtime import session_options

    config = mc.ModelConfig.FromString(sys.stdin.buffer.read())
    so = session_options(config)
    so.intra_op_num_threads = so.inter_op_num_threads = 1  # no pool threads: their stacks are address space
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    limit = _vm_size() + max_bytes + SLACK_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    error = ""
    try:
        ort.InferenceSession(model_file, so, providers=["CPUExecutionProvider"])
    except MemoryError:
        error = "MemoryError"
    except Exception as exc:  # not a model, bad graph: the service's own load says why
        error = str(exc)[:2000]
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_rss
    print(json.dumps({"grown": grown, "error": error}), flush=True)


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]))
