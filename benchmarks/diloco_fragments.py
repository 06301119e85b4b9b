"""Streaming DiLoCo's fragments on a scanned stack: the bytes each fragment's exchange sends.

A model of three leaves, an embedding, a head and one stacked leaf of ``--layers`` layers run
by ``jax.lax.scan``, as scanned models hold their layers. With fragments up to the number of
leaves, fragments are sets of whole leaves, and the stack goes whole into one of them; with
more fragments than leaves, the params are cut by rows, the stack by its layers. Compiles
each exchange (nothing runs) on 2 x 4 CPU devices and prints, per F, the bytes each device
sends between nodes in each fragment's exchange (``bytes_between_nodes``) and the fragments'
pieces. The figures are in benchmarks/RESULTS.md, "DiLoCo's fragments on a scanned stack".

    python benchmarks/diloco_fragments.py --layers 24 --dim 512 --fragments 1 3 4 8
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import jax_bytegrad  # noqa: E402


def model(layers: int, dim: int, vocab: int = 256):
    shapes = {
        "embed": jax.ShapeDtypeStruct((vocab, dim), jnp.float32),
        "stack": jax.ShapeDtypeStruct((layers, dim, dim), jnp.float32),
        "head": jax.ShapeDtypeStruct((dim, vocab), jnp.float32),
    }

    def loss_fn(params, batch):
        x = params["embed"][batch[0]]
        x = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, params["stack"])[0]
        return optax.softmax_cross_entropy_with_integer_labels(x @ params["head"], batch[1]).mean()

    return shapes, loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--inner-steps", type=int, default=48)
    parser.add_argument("--fragments", type=int, nargs="+", default=[1, 3, 4, 8])
    args = parser.parse_args()
    shapes, loss_fn = model(args.layers, args.dim)
    batch = (np.zeros(64, np.int32), np.zeros(64, np.int32))
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
    print("| F | kB per exchange, each fragment | largest / total | fragments |")
    print("|---|---|---:|---|")
    for f in args.fragments:
        strategy = jax_bytegrad.Strategy(
            "diloco", mesh=jax_bytegrad.make_mesh(2, 4), inner_steps=args.inner_steps,
            fragments=f, bits=4, error_feedback=True,
        )  # fmt: skip
        step = strategy.train_step(loss_fn, optax.adam(1e-3))
        sent = step.bytes_between_nodes(step.state_shapes(shapes), batch)
        phases = [v for k, v in sent.items() if k.startswith("outer")]
        pieces = [
            " + ".join(
                names[p.leaf] + ("" if p.dim is None else f"[{p.start}:{p.stop}]") for p in fragment
            )  # fmt: skip
            for fragment in step._layout.fragments
        ]
        print(
            f"| {f} | {', '.join(f'{v / 1e3:.1f}' for v in phases)} | "
            f"{max(phases) / sum(phases):.0%} | {'; '.join(pieces)} |"
        )


if __name__ == "__main__":
    main()
