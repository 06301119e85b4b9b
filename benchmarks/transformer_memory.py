"""Memory per device of Llama-style decoders trained with ``shard="params"``, as a list of
remat'd layers and as one scanned stack, read from the programs XLA:GPU compiles on a machine
without a GPU.

The model is ``_llama.py``'s (RMSNorm, rotary attention, SwiGLU, an untied head, each layer
under ``jax.checkpoint``), float32, trained by float32 AdamW after the sync, sequence 2048 and
one row per device, on ``--nodes`` x ``--per-node`` deviceless GPUs (``gpu_mesh``: needs JAX's
CUDA plugin, ``pip install -e '.[cuda12]'``). Each row is one compile, in a process of its own,
and prints:

- peak GiB per device (``MemoryStats.peak_bytes``), its arguments and temporaries;
- MiB each device sends between nodes per step (``communication_stats``), and against the
  replicated step's where that row was compiled too;
- the work beside those exchanges: the gemms scheduled between an exchange's start and done
  (a loop's counted once per iteration) of all the step's gemms, and their share of its FLOPs;
- the compile's seconds on this machine.

The floor beside it: the state's share (16 bytes per parameter for float32 AdamW, over the
devices of a node), one gathered layer and the activations a remat'd layer keeps.

Usage:
  python benchmarks/transformer_memory.py                          # 7b, 13b, 30b; list and scan
  python benchmarks/transformer_memory.py --models 7b --forms scan --shards none,params
  python benchmarks/transformer_memory.py --models 7b --forms scan,scan-marked   # exchange_in_loop
  python benchmarks/transformer_memory.py --models 70b --nodes 4 --forms scan-in,list-in \
      --shards full                                   # the state split across nodes too
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _llama  # noqa: E402

import jax_bytegrad as jbg  # noqa: E402
from jax_bytegrad.profiling import communication_stats, memory_stats  # noqa: E402
from jax_bytegrad.sharding import GPUS, gpu_mesh  # noqa: E402

SEQ = 2048
GIB, MIB = 2**30, 2**20
SHARDS = {"none": None, "optimizer": "optimizer", "params": "params", "full": "full"}
ALGORITHMS = {
    "bytegrad": ("bytegrad", {}),
    "gradient_allreduce": ("gradient_allreduce", {"hierarchical": True}),
    "bytegrad-4bit-ef": ("bytegrad", {"bits": 4, "error_feedback": True}),
    "bytegrad-4bit": ("bytegrad", {"bits": 4}),
    "bytegrad-4bit-ef-integer": (
        "bytegrad",
        {"bits": 4, "error_feedback": True, "wire": "allreduce"},
    ),
}


def measure(model: str, form: str, shard: str, algorithm: str, args) -> dict:
    """Compiles one train step and reads its figures."""
    shape = _llama.SHAPES[model]
    scan = form.startswith("scan")
    spec = GPUS[args.gpu]
    if args.device_gib:  # the same GPU with less memory: where XLA's rematerialization gives up
        spec = dataclasses.replace(spec, memory_bytes=int(args.device_gib * GIB))
    mesh = gpu_mesh(args.nodes, args.per_node, target_config=spec.target_config())
    name, settings = ALGORITHMS[algorithm]
    strategy = jbg.Strategy(name, mesh=mesh, shard=SHARDS[shard], **settings)
    batch = jax.ShapeDtypeStruct((mesh.devices.size, SEQ + 1), jnp.int32)
    mark = {"scan-marked": True, "scan-in": "inside", "list-in": "inside"}.get(form, False)
    loss = _llama.loss_fn(shape, scan=scan, mark=mark)
    with strategy.train_step(loss, optax.adamw(1e-4)) as step:
        # The batch shows the step the marks (error feedback lays out residuals for them).
        state = step.state_shapes(_llama.param_shapes(shape, scan=scan), batch)
        start = time.perf_counter()
        lowered = step.lower(state, batch)
        memory = memory_stats(lowered)  # compiles; communication_stats reuses the executable
        seconds = time.perf_counter() - start
        node = communication_stats(lowered).overlap_on("node")
    return {
        "peak": memory.peak_bytes,
        "args": memory.argument_bytes,
        "temp": memory.temp_bytes,
        "node_bytes": node.bytes_sent,
        "gemms": node.gemms,
        "gemms_beside": node.gemms_beside,
        "flops_share": node.flops_share,
        "seconds": seconds,
    }


def floor_bytes(shape: _llama.Shape, devices: int) -> float:
    """16 B per parameter over the ``devices`` that split the state, one gathered layer, and
    what the remat'd layers keep (each layer's input, float32) plus one layer's activations."""
    layer = 2 * shape.dim * (shape.dim + shape.kv_dim) + 3 * shape.dim * shape.ffn + 2 * shape.dim
    inputs = shape.layers * SEQ * shape.dim * 4
    activations = SEQ * (4 * shape.dim + 3 * shape.ffn) * 4 + shape.heads * SEQ * SEQ * 4 * 2
    return 16 * shape.parameters() / devices + 4 * layer + inputs + activations


def run_worker(spec: str, args) -> dict | None:
    command = [sys.executable, __file__, "--worker", spec, "--gpu", args.gpu]
    command += ["--nodes", str(args.nodes), "--per-node", str(args.per_node)]
    command += ["--device-gib", str(args.device_gib)] if args.device_gib else []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"  {spec}: no compile in {args.timeout} s", flush=True)
        return None
    if done.returncode:
        raise RuntimeError(f"{spec} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def report(rows: dict, args) -> None:
    print(
        f"\n{'model':6s} {'form':11s} {'algorithm':19s} {'shard':7s} {'params':>7s} "
        f"{'peak GiB':>9s} {'args':>6s} {'temp':>6s} {'floor':>6s} {'MiB/node':>9s} "
        f"{'vs none':>8s} {'gemms beside':>14s} {'FLOPs':>6s} {'compile s':>9s}"
    )
    for (model, form, algorithm, shard), row in rows.items():
        shape = _llama.SHAPES[model]
        head = f"{model:6s} {form:11s} {algorithm:19s} {shard:7s} {shape.parameters() / 1e9:6.2f}B"
        if row is None:
            print(f"{head} no compile in time")
            continue
        base = rows.get((model, form, algorithm, "none"))
        ratio = f"{row['node_bytes'] / base['node_bytes']:8.4f}" if base else f"{'':8s}"
        split = args.per_node * (args.nodes if shard == "full" else 1)
        floor = floor_bytes(shape, split) / GIB
        print(
            f"{head} {row['peak'] / GIB:9.2f} {row['args'] / GIB:6.2f} {row['temp'] / GIB:6.2f} "
            f"{floor:6.2f} {row['node_bytes'] / MIB:9.2f} {ratio} "
            f"{row['gemms_beside']:>6d} of {row['gemms']:<5d} {row['flops_share']:6.1%} "
            f"{row['seconds']:9.0f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--models", default="7b,13b,30b")
    parser.add_argument(
        "--forms",
        default="scan,list",
        help="scan, list, or scan-marked: the scan body marks its layer with exchange_in_loop; "
        "scan-in, list-in: each layer marks its params inside its jax.checkpoint (shard=full)",
    )
    parser.add_argument("--algorithms", default="bytegrad")
    parser.add_argument("--shards", default="params")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per compile")
    parser.add_argument("--device-gib", type=float, default=None, help="the GPU's memory instead")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        model, form, algorithm, shard = args.worker.split(",")
        print(json.dumps(measure(model, form, shard, algorithm, args)), flush=True)
        return
    print(
        f"JAX {jax.__version__}; {args.nodes} x {args.per_node} {args.gpu} "
        f"({GPUS[args.gpu].memory_bytes / GIB:.2f} GiB each), deviceless; sequence {SEQ}, one "
        f"row per device; float32 AdamW; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    rows = {}
    for model in args.models.split(","):
        for form in args.forms.split(","):
            for algorithm in args.algorithms.split(","):
                for shard in args.shards.split(","):
                    spec = f"{model},{form},{algorithm},{shard}"
                    rows[(model, form, algorithm, shard)] = run_worker(spec, args)
                    report({k: rows[k] for k in list(rows)[-1:]}, args)
    report(rows, args)


if __name__ == "__main__":
    main()
