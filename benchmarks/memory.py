"""Memory per device of train steps whose state is split within a node (``shard=``), and what
they send between nodes, read from the programs XLA:GPU compiles on a machine without a GPU.

Compiles each algorithm's train step for ``--nodes`` x ``--per-node`` deviceless GPUs
(``jax_bytegrad.sharding.gpu_mesh``: needs JAX's CUDA plugin, ``pip install -e '.[cuda12]'``),
with its state replicated (``shard=None``), split within the node (``"optimizer"``), or with
the params split too (``"params"``), and prints per device and per phase:

- GiB: ``MemoryStats.peak_bytes`` (arguments, outputs not written into donated arguments,
  temporaries and code: what the device must hold at once, at most), the arguments (the
  state's share and the batch) and the temporaries (gathered layers, activations, gradients,
  the wires' buffers), from XLA's memory analysis of the compiled step;
- MiB between nodes (``communication_stats``'s ``bytes_on("node")``), against the replicated
  step's; how many of the step's gemms run while a collective between nodes is in flight
  (``overlap_on("node").gemms_beside``, a loop's once per iteration) and their share of the
  step's FLOPs; and, secondary, the share of the bytes whose collective starts before the
  step's last gemm (``early_share``: starting early is not running beside compute).

Model: N float32 8192 x 8192 layers, ReLU between them, mean squared error (the MLP of
``gpu_schedule.py``; 96 layers are 6.44B parameters), 16 rows per device (a global batch of
256 on 2 x 8 GPUs): the state, not the activations, is what must fit. Optimizer: float32
``optax.adam`` after the sync; QAdam is its own (both its phases). Each step is compiled once
and both figures read from that executable.

``--stacked`` makes the layers one ``(layers, 8192, 8192)`` leaf that the loss runs with
``jax.lax.scan``, as a scanned stack of layers (``nnx.scan``) holds them.

``--search`` bisects on the layer count for the largest model whose ``shard="params"`` step
fits the GPU's memory (``GPUS[gpu].memory_bytes``, 79.2 GiB for an H100 80GB): its peak
(the largest phase's), with every probe printed.

Usage:
  python benchmarks/memory.py                                  # 96 layers, every row
  python benchmarks/memory.py --layers 48,96 --algorithms bytegrad
  python benchmarks/memory.py --search bytegrad,qadam          # largest that fits
  python benchmarks/memory.py --layers 448 --algorithms bytegrad --shards params --stacked
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_schedule  # noqa: E402

import jax_bytegrad as jbg  # noqa: E402
from jax_bytegrad.profiling import MemoryStats, communication_stats, memory_stats  # noqa: E402
from jax_bytegrad.sharding import GPUS, gpu_mesh  # noqa: E402

DIM = 8192
PER_DEVICE = 16
GIB, MIB = 2**30, 2**20

# name -> (algorithm, its settings, {phase: the first step count that runs it}).
QADAM = {"learning_rate": 1e-3, "warmup_steps": 2}
ALGORITHMS = {
    # Hierarchical, as every sharded step's sync between nodes is; "gradient_allreduce
    # (flat)" is the default replicated step (one all-reduce over all devices).
    "gradient_allreduce": ("gradient_allreduce", {"hierarchical": True}, {"step": 0}),
    "gradient_allreduce (flat)": ("gradient_allreduce", {}, {"step": 0}),
    "bytegrad": ("bytegrad", {}, {"step": 0}),
    "bytegrad 4-bit + EF": ("bytegrad", {"bits": 4, "error_feedback": True}, {"step": 0}),
    "qadam": ("qadam", QADAM, {"warmup": 0, "compressed": QADAM["warmup_steps"]}),
}
DEFAULT_ALGORITHMS = ("gradient_allreduce", "bytegrad", "bytegrad 4-bit + EF", "qadam")
SHARDS = {"none": None, "optimizer": "optimizer", "params": "params"}


class Row(NamedTuple):
    """One compiled phase's figures."""

    memory: MemoryStats
    node_bytes: float
    gemms_beside: int
    gemms: int
    flops_share: float
    early_share: float


def measure(mesh, layers: int, name: str, shard: str | None, stacked: bool) -> dict[str, Row]:
    """Compiles one step of ``layers`` layers, each phase once: ``{phase: Row}``."""
    algorithm, settings, phases = ALGORITHMS[name]
    params, loss_fn, batch = gpu_schedule.mlp(layers, DIM, PER_DEVICE, stacked=stacked)
    batch = batch(mesh.devices.size)
    strategy = jbg.Strategy(algorithm, mesh=mesh, shard=shard, **settings)
    optimizer = None if algorithm == "qadam" else optax.adam(1e-3)
    rows = {}
    with strategy.train_step(loss_fn, optimizer) as step:
        state = step.state_shapes(params)
        for phase, taken in phases.items():
            at = state._replace(step=np.asarray(taken, np.asarray(state.step).dtype))
            # One compile: Lowered.compile() keeps its executable for the second reader.
            lowered = step.lower(at, batch)
            o = communication_stats(lowered).overlap_on("node")
            rows[phase] = Row(memory_stats(lowered), o.bytes_sent, o.gemms_beside, o.gemms,
                              o.flops_share, o.early_share)  # fmt: skip
    return rows


def run_worker(layers: int, name: str, shard: str, args) -> dict[str, Row] | None:
    """``measure`` in a process of its own (a compile's memory is given back when it ends),
    under ``args.timeout`` seconds: ``{phase: Row}``, or None when it ran out of time."""
    command = [sys.executable, __file__, "--worker", f"{layers},{name},{shard}"]
    command += ["--gpu", args.gpu, "--nodes", str(args.nodes), "--per-node", str(args.per_node)]
    command += ["--stacked"] if args.stacked else []
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        print(f"  {name}, shard={shard}, {layers} layers: no compile in {args.timeout} s")
        return None
    if done.returncode:
        raise RuntimeError(f"{name}, shard={shard}, {layers} layers failed:\n{done.stderr}")
    rows = {}
    for line in done.stdout.splitlines():
        phase, fields = json.loads(line)
        rows[phase] = Row(MemoryStats(**fields.pop("memory")), **fields)
    return rows


def largest_fitting(name: str, device_bytes: int, lo: int, hi: int, args) -> tuple:
    """Bisects on the layer count in ``[lo, hi]`` for the largest whose ``shard="params"``
    step's peak (its largest phase's) fits ``device_bytes``: ``(layers or None when ``lo``
    does not fit, {layers: peak bytes} of every probe)``. A probe that does not compile in
    time counts as not fitting."""
    probes = {}

    def fits(layers):
        rows = run_worker(layers, name, "params", args)
        if rows is None:
            return False
        probes[layers] = max(row.memory.peak_bytes for row in rows.values())
        print(f"  {name}, {layers} layers: {probes[layers] / GIB:.2f} GiB", flush=True)
        return probes[layers] <= device_bytes

    if not fits(lo):
        return None, probes
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo, probes


def billions(layers: int) -> float:
    return layers * DIM * DIM / 1e9


def report(layers: int, table: dict) -> None:
    """``table[(name, shard)] = {phase: Row}`` (None: no compile in time) as one table, the
    bytes between nodes against the same algorithm's with ``shard=None``."""
    print(f"\n{layers} x {DIM}^2 float32 layers ({billions(layers):.2f}B parameters)")
    print(
        f"{'step':26s} {'shard':9s} {'phase':10s} {'peak GiB':>9s} {'args':>7s} {'temp':>7s} "
        f"{'MiB between nodes':>18s} {'vs none':>8s} {'gemms beside':>14s} {'FLOPs':>6s} "
        f"{'early':>6s}"
    )
    for (name, shard), rows in table.items():
        if rows is None:
            print(f"{name:26s} {shard:9s} no compile in time")
            continue
        for phase, row in rows.items():
            base = (table.get((name, "none")) or {}).get(phase)
            ratio = f"{row.node_bytes / base.node_bytes:8.4f}" if base else f"{'':8s}"
            m = row.memory
            print(
                f"{name:26s} {shard:9s} {phase:10s} {m.peak_bytes / GIB:9.2f} "
                f"{m.argument_bytes / GIB:7.2f} {m.temp_bytes / GIB:7.2f} "
                f"{row.node_bytes / MIB:18.2f} {ratio} {row.gemms_beside:>6d} of {row.gemms:<5d} "
                f"{row.flops_share:6.1%} {row.early_share:6.0%}"
            )


def worker(spec: str, mesh, stacked: bool) -> None:
    """``--worker LAYERS,NAME,SHARD``: one JSON line per phase on stdout."""
    layers, name, shard = spec.split(",")
    for phase, row in measure(mesh, int(layers), name, SHARDS[shard], stacked).items():
        fields = {**row._asdict(), "memory": dataclasses.asdict(row.memory)}
        print(json.dumps([phase, fields]), flush=True)


def search(args, device_bytes: int) -> None:
    """``--search``: the largest layer count that fits, per algorithm."""
    lo, hi = (int(x) for x in args.search_range.split(","))
    for name in args.search.split(","):
        found, probes = largest_fitting(name, device_bytes, lo, hi, args)
        tried = ", ".join(f"{n}: {p / GIB:.2f}" for n, p in sorted(probes.items()))
        if found is None:
            print(f"{name}, shard='params': {lo} layers do not fit (GiB by layers: {tried})")
            continue
        print(
            f"{name}, shard='params': at most {found} layers fit ({billions(found):.2f}B "
            f"parameters, {probes[found] / GIB:.2f} of {device_bytes / GIB:.2f} GiB); "
            f"GiB by layers: {tried}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=8)
    parser.add_argument("--layers", default="96", help="comma-separated layer counts")
    parser.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS))
    parser.add_argument("--shards", default=",".join(SHARDS))
    parser.add_argument("--search", default=None, help="algorithms to bisect for, comma-separated")
    parser.add_argument("--search-range", default="96,845", help="lo,hi layer counts")
    parser.add_argument("--stacked", action="store_true", help="one scanned leaf of layers")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per compile")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, gpu_mesh(args.nodes, args.per_node, args.gpu), args.stacked)
        return
    device_bytes = GPUS[args.gpu].memory_bytes
    print(
        f"JAX {jax.__version__}; {args.nodes} x {args.per_node} {args.gpu} "
        f"({device_bytes / GIB:.2f} GiB each), compiled deviceless; {PER_DEVICE} rows per "
        f"device; {'one scanned stack of' if args.stacked else 'a list of'} layers; "
        f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    if args.search:
        search(args, device_bytes)
        return
    for layers in (int(x) for x in args.layers.split(",")):
        table = {}
        for name in args.algorithms.split(","):
            for shard in args.shards.split(","):
                table[(name, shard)] = run_worker(layers, name, shard, args)
        report(layers, table)


if __name__ == "__main__":
    main()
