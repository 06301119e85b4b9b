"""How much of each step's traffic between nodes overlaps the backward pass on a GPU cluster,
read from the schedule XLA:GPU compiles for it, on a machine without a GPU.

Compiles each algorithm's train step for ``--nodes`` x ``--per-node`` deviceless GPUs
(``jax_bytegrad.sharding.gpu_mesh``: needs JAX's CUDA plugin, ``pip install -e '.[cuda12]'``)
and prints, from ``communication_stats``'s ``overlap_on("node")``: the bytes each device
sends between nodes, how many of the step's gemms (and what share of their FLOPs) run while
a collective between nodes is in flight, a loop's once per iteration, and, as a secondary
figure, the share of the bytes whose collectives start before the step's last gemm
(starting early is not running beside compute).

The compressed steps run with the library's default buckets (``bucket_bytes="auto"``: on
a GPU mesh 24 MiB buckets of at least two leaves), or ``--bucket-mib``'s plain size.

Models:
  mlp          eight 2048 x 2048 layers (32M parameters), batch 64 per device (--mlp-dim,
               --mlp-layers).
  transformer  examples/models.py's CharTransformer, made larger (--dim, --depth).
  --stacked    the MLP's layers as one leaf run by ``jax.lax.scan``: the backward pass is
               one loop, whose gemms count once per iteration.

Usage:
  python benchmarks/gpu_schedule.py                       # both models, 2 x 4 H100
  python benchmarks/gpu_schedule.py --model mlp --gpu h200
  python benchmarks/gpu_schedule.py --bucket-mib 32        # bucket_bytes of the compressed
  python benchmarks/gpu_schedule.py --model mlp --stacked  # the MLP as a scanned stack
"""

import argparse
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax_bytegrad as jbg  # noqa: E402
from jax_bytegrad.sharding import gpu_mesh  # noqa: E402

# name -> (algorithm, its settings); the phase reported is the one that runs most steps.
QADAM = {"learning_rate": 1e-3, "warmup_steps": 2}
ALGORITHMS = {
    "gradient_allreduce": ("gradient_allreduce", {}, "step"),
    "gradient_allreduce (hier.)": ("gradient_allreduce", {"hierarchical": True}, "step"),
    "bytegrad": ("bytegrad", {}, "step"),
    "bytegrad 4-bit + EF": ("bytegrad", {"bits": 4, "error_feedback": True}, "step"),
    "qadam (compressed)": ("qadam", QADAM, "compressed"),
    "qadam (warm-up)": ("qadam", QADAM, "warmup"),
}


def mlp(layers: int = 8, dim: int = 2048, per_device: int = 64, stacked: bool = False):
    """The issue's MLP: params, loss_fn and a global batch, all abstract. ``stacked``: its
    layers as one ``(layers, dim, dim)`` leaf that ``jax.lax.scan`` runs (ReLU after each),
    as a scanned stack of layers (``nnx.scan``) holds them."""

    def loss_fn(params, batch):
        x, y = batch
        if stacked:
            x = jax.lax.scan(lambda x, w: (jax.nn.relu(x @ w), None), x, params)[0]
        else:
            for i, w in enumerate(params):
                x = x @ w
                if i < len(params) - 1:
                    x = jax.nn.relu(x)
        return jnp.mean((x - y) ** 2)

    params = [jax.ShapeDtypeStruct((dim, dim), jnp.float32) for _ in range(layers)]
    if stacked:
        params = jax.ShapeDtypeStruct((layers, dim, dim), jnp.float32)
    return (
        params,
        loss_fn,
        lambda devices: (jax.ShapeDtypeStruct((devices * per_device, dim), jnp.float32),) * 2,
    )


def transformer(dim: int, depth: int, seq_len: int = 256, per_device: int = 8):
    """examples/models.py's CharTransformer at the given size."""
    from flax import nnx

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import models

    model = nnx.eval_shape(
        lambda: models.CharTransformer(
            256,
            seq_len=seq_len,
            dim=dim,
            depth=depth,
            num_heads=max(4, dim // 128),
            rngs=nnx.Rngs(0),
        )
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(params, batch):
        tokens, targets = batch
        logits = nnx.merge(graphdef, params, rest)(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    return (
        params,
        loss_fn,
        lambda devices: (jax.ShapeDtypeStruct((devices * per_device, seq_len), jnp.int32),) * 2,
    )


def measure(mesh, params, loss_fn, batch, bucket_bytes=None):
    """One row per algorithm: the node axis's ``Overlap`` of its phase; ``bucket_bytes``
    (None: the default) for the algorithms that bucket."""
    rows = {}
    for name, (algorithm, settings, phase) in ALGORITHMS.items():
        if bucket_bytes is not None and algorithm != "gradient_allreduce":
            settings = {**settings, "bucket_bytes": bucket_bytes}
        strategy = jbg.Strategy(algorithm, mesh=mesh, **settings)
        step = strategy.train_step(loss_fn, None if algorithm == "qadam" else optax.adam(1e-3))
        stats = step.communication_stats(step.state_shapes(params), batch)
        rows[name] = stats[phase].overlap_on("node")
    return rows


def report(title: str, rows) -> None:
    print(f"\n{title}")
    print(
        f"{'step':28s} {'MiB between nodes':>18s} {'gemms beside':>14s} {'FLOPs beside':>13s} "
        f"{'started early':>14s}"
    )
    for name, o in rows.items():
        print(
            f"{name:28s} {o.bytes_sent / 2**20:18.2f} {o.gemms_beside:>6d} of {o.gemms:<5d} "
            f"{o.flops_share:13.1%} {o.early_share:14.0%}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("mlp", "transformer", "both"), default="both")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--per-node", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--mlp-dim", type=int, default=2048)
    parser.add_argument("--mlp-layers", type=int, default=8)
    parser.add_argument(
        "--bucket-mib", type=int, default=None, help="bucket_bytes in MiB (default: 'auto')"
    )
    parser.add_argument("--stacked", action="store_true", help="the MLP as one scanned leaf")
    args = parser.parse_args()
    bucket_bytes = None if args.bucket_mib is None else args.bucket_mib * 2**20
    mesh = gpu_mesh(args.nodes, args.per_node, args.gpu)
    devices = args.nodes * args.per_node
    print(f"JAX {jax.__version__}; {args.nodes} x {args.per_node} {args.gpu}, compiled deviceless")
    models = {
        "mlp": lambda: mlp(args.mlp_layers, args.mlp_dim, stacked=args.stacked),
        "transformer": lambda: transformer(args.dim, args.depth),
    }
    for name in models if args.model == "both" else (args.model,):
        params, loss_fn, batch = models[name]()
        size = sum(math.prod(p.shape) for p in jax.tree.leaves(params)) / 1e6
        rows = measure(mesh, params, loss_fn, batch(devices), bucket_bytes)
        report(f"{name} ({size:.1f}M parameters)", rows)


if __name__ == "__main__":
    main()
