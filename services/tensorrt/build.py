"""`meshserve build-trt MODEL.onnx -o model.plan`: build a TensorRT plan from an ONNX model.

The ONNX model's first dimension is the batch when it is dynamic; one optimization profile
covers `--min-batch`..`--max-batch` (tuned for `--opt-batch`, default the max). Other dynamic
dimensions are refused (export the model with fixed non-batch dimensions). The plan only loads
with the TensorRT version and GPU architecture it was built with, so build it where it runs.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class BuildError(Exception):
    """The plan cannot be built; the message says why."""


@dataclass(frozen=True)
class BatchRange:
    min: int
    opt: int
    max: int

    @classmethod
    def from_args(cls, min_batch: int, opt_batch: int | None, max_batch: int) -> BatchRange:
        opt = max_batch if opt_batch is None else opt_batch
        if not 1 <= min_batch <= opt <= max_batch:
            raise BuildError(f"batch sizes must satisfy 1 <= --min-batch ({min_batch}) <= --opt-batch ({opt}) "
                             f"<= --max-batch ({max_batch})")
        return cls(min_batch, opt, max_batch)


def profile_shapes(inputs: Sequence[tuple[str, Sequence[int]]], batch: BatchRange
                   ) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(min, opt, max) shape per input that has a dynamic dimension; {} for a fully static model.

    Only the first dimension may be dynamic (-1): it is the batch.
    """
    out: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
    bad: list[str] = []
    for name, shape in inputs:
        dims = tuple(int(d) for d in shape)
        if not any(d < 0 for d in dims):
            continue
        if any(d < 0 for d in dims[1:]) or not dims:
            bad.append(f"'{name}' {list(dims)}")
            continue
        rest = dims[1:]
        out[name] = ((batch.min, *rest), (batch.opt, *rest), (batch.max, *rest))
    if bad:
        raise BuildError("only the first (batch) dimension may be dynamic; inputs with other dynamic dimensions: "
                         + ", ".join(bad) + " (export the ONNX model with fixed non-batch dimensions)")
    return out


def config_hint(inputs: Sequence[tuple[str, Sequence[int], str]], outputs: Sequence[tuple[str, Sequence[int], str]],
                batched: bool, max_batch: int) -> str:
    """A config.pbtxt for the plan (TensorRT models are not auto-completed)."""
    def entries(items: Sequence[tuple[str, Sequence[int], str]]) -> str:
        rows = []
        for name, shape, dt in items:
            dims = list(shape)[1:] if batched else list(shape)
            rows.append(f'  {{ name: "{name}" data_type: TYPE_{dt} dims: {dims} }}')
        return ",\n".join(rows)

    return (f'platform: "tensorrt_plan"\nmax_batch_size: {max_batch if batched else 0}\n'
            f"input [\n{entries(inputs)}\n]\noutput [\n{entries(outputs)}\n]\n"
            + ("dynamic_batching { }\n" if batched else ""))


_CONFIG_TYPE = {"FLOAT": "FP32", "HALF": "FP16", "INT8": "INT8", "INT32": "INT32", "INT64": "INT64",
                "BOOL": "BOOL", "UINT8": "UINT8"}


def build_plan(onnx_path: str, batch: BatchRange, fp16: bool, workspace_mib: int | None,
               log: Any = print) -> tuple[bytes, str]:
    """Build and serialize the engine; returns (plan bytes, config.pbtxt hint)."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: explicit batch is the only mode
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(onnx_path):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise BuildError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
    config = builder.create_builder_config()
    if workspace_mib:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    ins = [network.get_input(i) for i in range(network.num_inputs)]
    outs = [network.get_output(i) for i in range(network.num_outputs)]
    shapes = profile_shapes([(t.name, tuple(t.shape)) for t in ins], batch)
    if shapes:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    log(f"build-trt: building {'FP16' if fp16 else 'FP32'} engine for {len(ins)} input(s)"
        + (f", batch {batch.min}..{batch.max} (opt {batch.opt})" if shapes else " (static shapes)"))
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise BuildError("TensorRT could not build the engine (see the TensorRT messages above)")

    def described(ts: list[Any]) -> list[tuple[str, tuple[int, ...], str]]:
        return [(t.name, tuple(t.shape), _CONFIG_TYPE.get(t.dtype.name, t.dtype.name)) for t in ts]

    batched = bool(shapes) and all(tuple(t.shape)[:1] == (-1,) for t in ins)
    return bytes(serialized), config_hint(described(ins), described(outs), batched, batch.max)


def main(args: argparse.Namespace) -> None:
    from services.tensorrt.main import require_tensorrt

    require_tensorrt("meshserve build-trt")
    if not args.onnx.is_file():
        raise SystemExit(f"meshserve build-trt: {args.onnx} does not exist")
    try:
        batch = BatchRange.from_args(args.min_batch, args.opt_batch, args.max_batch)
        plan, hint = build_plan(str(args.onnx), batch, args.fp16, args.workspace_mib)
    except BuildError as exc:
        raise SystemExit(f"meshserve build-trt: {exc}") from None
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_bytes(plan)
    print(f"build-trt: wrote {args.output} ({len(plan)} bytes). A config.pbtxt for it:\n\n{hint}", file=sys.stdout)
