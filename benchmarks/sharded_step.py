"""Benchmark: ByteGrad's train step, replicated against its state sharded within each node, in
one process (in-process collectives, no Gloo): the counterpart of network.py's
``train_bytegrad_shard_*`` ops between hosts.

Usage::

    taskset -c 0 python benchmarks/sharded_step.py --nodes 2 --devices-per-node 2 --steps 7

The steps of the 25.2M-parameter MLP of ``_mlp.py`` (``optax.chain(bytegrad(), adam)``, every
default, state donated), 16 rows per device, take turns step by step; the median of each and
its ratio to the replicated one are printed.
"""

import argparse
import os
import statistics
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--devices-per-node", type=int, default=2)
    parser.add_argument("--num-params", type=int, default=25_200_000)
    parser.add_argument("--steps", type=int, default=7, help="timed steps (median reported)")
    args = parser.parse_args(argv)
    devices = args.nodes * args.devices_per_node
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import jax
    import numpy as np
    import optax
    from _mlp import mlp_batch, mlp_init, mlp_loss

    import jax_bytegrad

    mesh = jax_bytegrad.make_mesh(args.nodes, args.devices_per_node)
    batch = jax_bytegrad.sharding.shard_batch(
        mlp_batch(np.random.default_rng(0), 16 * devices), mesh
    )
    steps, states = {}, {}
    for shard in (None, "optimizer", "params"):
        tx = optax.chain(jax_bytegrad.bytegrad(), optax.adam(1e-4))
        steps[shard] = jax_bytegrad.data_parallel_step(mlp_loss, tx, mesh, shard=shard)
        states[shard] = steps[shard].init(mlp_init(args.num_params))
        for _ in range(2):  # compile, then one untimed step
            states[shard], metrics = steps[shard](states[shard], batch)
            jax.block_until_ready(metrics)
    times = {shard: [] for shard in steps}
    for _ in range(args.steps):
        for shard, step in steps.items():
            start = time.perf_counter()
            states[shard], metrics = step(states[shard], batch)
            jax.block_until_ready((states[shard], metrics))
            times[shard].append(time.perf_counter() - start)
    base = statistics.median(times[None])
    print(f"JAX {jax.__version__}, mesh {dict(mesh.shape)}, {args.num_params:,} parameters")
    for shard, t in times.items():
        median = statistics.median(t)
        print(f"shard={shard}: median {1e3 * median:.1f} ms ({median / base:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
