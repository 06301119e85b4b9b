"""Bytes between nodes per inner step: DiLoCo against an all-reduce or ByteGrad every step.

Compiles each step (nothing runs) on CPU devices simulating nodes, reads the bytes each device
sends over the links between nodes from the compiled HLO (``communication_stats``), and
averages DiLoCo's over one period of H inner steps (``bytes_between_nodes``). Prints a
markdown table; the figures are in benchmarks/RESULTS.md, "DiLoCo".

    python benchmarks/diloco_bytes.py --params 4000000 --nodes 2 --local 4
"""

import argparse
import os
import sys


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--params", type=int, default=4_000_000, help="MLP parameters")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=4, help="devices per node")
    p.add_argument("--inner-steps", type=int, nargs="+", default=[10, 50, 100])
    return p


# Registry: (label, Strategy name, settings); DiLoCo's rows are built per H in main.
BASELINES = [
    ("gradient_allreduce (float32, hierarchical)", "gradient_allreduce", {"hierarchical": True}),
    ("bytegrad 8-bit", "bytegrad", {}),
    ("bytegrad 4-bit + EF", "bytegrad", {"bits": 4, "error_feedback": True}),
    ("bytegrad 2-bit + EF", "bytegrad", {"bits": 2, "error_feedback": True}),
]
OUTER = [
    ("8-bit", {"bits": 8}),
    ("4-bit + EF", {"bits": 4, "error_feedback": True}),
    ("2-bit + EF", {"bits": 2, "error_feedback": True}),
]


def _per_step(strategy, loss, params, batch) -> float:
    """Bytes each device sends between nodes per step (DiLoCo: averaged over H steps)."""
    import optax

    with strategy.train_step(loss, optax.sgd(0.1)) as step:
        state = step.state_shapes(params)
        if strategy.algorithm == "diloco":
            return step.bytes_between_nodes(state, batch)["per_inner_step"]
        (stats,) = step.communication_stats(state, batch).values()
        return stats.bytes_on("node")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    devices = args.nodes * args.local
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    import jax.numpy as jnp

    sys.path.insert(0, os.path.dirname(__file__))
    from _mlp import MLP_IN, MLP_OUT, mlp_init, mlp_loss

    import jax_bytegrad

    mesh = jax_bytegrad.make_mesh(args.nodes, args.local)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), mlp_init(args.params))
    count = sum(x.size for x in jax.tree.leaves(params))
    rows = devices * 2
    batch = (
        jax.ShapeDtypeStruct((rows, MLP_IN), jnp.float32),
        jax.ShapeDtypeStruct((rows, MLP_OUT), jnp.float32),
    )
    rows_out = []
    for label, name, kwargs in BASELINES:
        s = jax_bytegrad.Strategy(name, mesh=mesh, **kwargs)
        rows_out.append((label, _per_step(s, mlp_loss, params, batch)))
    for h in args.inner_steps:
        for label, kwargs in OUTER:
            s = jax_bytegrad.Strategy("diloco", mesh=mesh, inner_steps=h, delay=0, **kwargs)
            rows_out.append((f"diloco H={h}, {label}", _per_step(s, mlp_loss, params, batch)))
    base = rows_out[0][1]
    print(f"{count:,} parameters, {args.nodes} nodes x {args.local} devices; bytes per device")
    print("| step | bytes between nodes per step | fewer than float32 every step |")
    print("|---|---:|---:|")
    for label, b in rows_out:
        print(f"| {label} | {b:,.0f} | {base / b:,.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
