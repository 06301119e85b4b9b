"""Bytes between nodes with and without ``exchange_in_loop``, for scanned stacks of several widths.

A ``shard="params"`` step whose scan body marks its layer (``jax_bytegrad.sharding.
exchange_in_loop``) exchanges each layer's gradient between nodes inside the backward loop,
in the layer's own buckets; unmarked, the stack's gradient crosses after the loop in the
step's buckets. The codes per value are the same, so the bytes differ only by padding: each
layer's bucket is padded to whole blocks of every device's row. This prints, per width, the
bytes one step sends between nodes (per device, read from the compiled step's
``communication_stats``, a loop's exchanges counted as many times as the loop runs) and the
ratio marked / unmarked.

    python benchmarks/loop_exchange_bytes.py [--widths 64,256,1024] [--layers 4]
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jax_bytegrad  # noqa: E402
from jax_bytegrad.sharding import exchange_in_loop  # noqa: E402


def node_bytes(width: int, layers: int, mark: bool, algorithm: str) -> float:
    """Bytes one step of a marked (or unmarked) stack sends between nodes, per device."""

    def loss_fn(params, batch):
        def layer(h, w):
            w = exchange_in_loop(w) if mark else w
            return jnp.tanh(h @ w), None

        h, _ = jax.lax.scan(jax.checkpoint(layer), batch[0], params["stack"])
        logits = h @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    rng = np.random.default_rng(0)
    params = {
        "stack": rng.normal(size=(layers, width, width)).astype(np.float32) / np.sqrt(width),
        "head": rng.normal(size=(width, 8)).astype(np.float32),
    }
    batch = (rng.normal(size=(16, width)).astype(np.float32), np.zeros(16, np.int32))
    mesh = jax_bytegrad.make_mesh(2, 4)
    strategy = jax_bytegrad.Strategy(algorithm, mesh=mesh, shard="params")
    with strategy.train_step(loss_fn, optax.adam(1e-3)) as step:
        state = step.init(params)
        stats = step.communication_stats(state, batch)["step"]
    return sum(row.bytes_sent for row in stats.rows if row.axes == "node")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="64,256,1024")
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    print("| algorithm | stack | unmarked B | marked B | marked / unmarked |")
    print("|---|---|---:|---:|---:|")
    for algorithm in ("gradient_allreduce", "bytegrad"):
        for width in map(int, args.widths.split(",")):
            plain = node_bytes(width, args.layers, False, algorithm)
            marked = node_bytes(width, args.layers, True, algorithm)
            stack = f"{args.layers} x {width}x{width}"
            print(
                f"| {algorithm} | {stack} | {plain:,.0f} | {marked:,.0f} | {marked / plain:.4f} |"
            )


if __name__ == "__main__":
    main()
