"""How much of a ``shard="params"`` step's traffic between nodes overlaps the backward pass,
with and without the step's cap on XLA:GPU's reduce-scatter combiner, compiled for GPUs that
are not here (``jax_bytegrad.sharding.gpu_mesh``: needs JAX's CUDA plugin).

With ``"params"`` the loss gathers each leaf within the node, and ``jax.grad`` turns each
gather into a reduce-scatter of that leaf's gradient. XLA:GPU's combiner merges reduce-scatters
up to 30 MiB by default, which joins them after the last gradient; the step compiles with a
4 MiB threshold instead (``data_parallel.RS_COMBINE_BYTES``). This sets it to "no limit" too,
through that private constant, and prints ``overlap_on("node")`` of both.

Model: ``gpu_schedule.py``'s MLP (eight 2048 x 2048 layers, 64 rows per device).

Usage:
  python benchmarks/sharded_overlap.py                # 2 x 4 H100
  python benchmarks/sharded_overlap.py --nodes 2 --per-node 8
"""

import argparse
import sys
from pathlib import Path

import jax
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_schedule  # noqa: E402

import jax_bytegrad as jbg  # noqa: E402
from jax_bytegrad._src.steps import data_parallel  # noqa: E402
from jax_bytegrad.profiling import communication_stats  # noqa: E402
from jax_bytegrad.sharding import gpu_mesh  # noqa: E402

STEPS = {
    "bytegrad": {},
    "bytegrad 4-bit + EF": {"bits": 4, "error_feedback": True},
    "gradient_allreduce(hierarchical=True)": {"hierarchical": True},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=4)
    args = parser.parse_args()
    mesh = gpu_mesh(args.nodes, args.per_node)
    params, loss_fn, batch = gpu_schedule.mlp()
    print(f"JAX {jax.__version__}; {args.nodes} x {args.per_node} H100, compiled deviceless")
    cap = data_parallel.RS_COMBINE_BYTES
    for threshold, label in ((cap, f"{cap // 2**20} MiB (the step's)"), (2**40, "no limit")):
        data_parallel.RS_COMBINE_BYTES = threshold
        for name, settings in STEPS.items():
            algorithm = name.split(" ")[0].split("(")[0]
            strategy = jbg.Strategy(algorithm, mesh=mesh, shard="params", **settings)
            with strategy.train_step(loss_fn, optax.adam(1e-3)) as step:
                lowered = step.lower(step.state_shapes(params), batch(mesh.devices.size))
                overlap = communication_stats(lowered).overlap_on("node")
            print(f"combine {label:18s} {name:38s} {overlap}", flush=True)
    data_parallel.RS_COMBINE_BYTES = cap


if __name__ == "__main__":
    main()
