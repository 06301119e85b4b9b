"""How to code the weights that ``shard="full"`` gathers between nodes: the error of each choice.

Each step a ``shard="full"`` forward computes on weights gathered from every device's block.
Between nodes the blocks cross as codes, so the forward computes on decoded weights, not on the
float32 masters. Two ways to code them (issue 63, item 2):

- **fresh codes** (ZeRO++'s qwZ; what ``shard="full"`` runs): each step, each block's weights
  coded min-max to ``bits`` and decoded;
- **difference codes** (SDP4Bit's idea): every node keeps the copy it decoded last step, and
  each step only ``master - copy`` crosses, coded to ``bits``; the copy then adds the decoded
  difference. What was lost one step is in the next step's difference (error feedback).

This runs the training once (``full_sharding.py``'s model and data, ``shard=None``, float32
AdamW), keeps the master weights of every step, and codes each device's blocks (2 x 4 devices,
split as ``shard="full"`` splits them) both ways. It prints the relative error
``|decoded - master| / |master|`` (Frobenius over every split leaf) at chosen steps, and the
bytes per weight each sends per gather (codes and their float32 headers).

The simulation does not feed the decoded weights back into training: it measures the error
each coding makes on the same trajectory.

Usage:
  python benchmarks/weight_codes.py                  # 300 steps, seed 0
  python benchmarks/weight_codes.py --steps 100 --every 25
"""

import argparse
import functools
import sys
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _llama  # noqa: E402
import full_sharding  # noqa: E402

import jax_bytegrad as jbg  # noqa: E402
from jax_bytegrad._src.codecs import Codec  # noqa: E402
from jax_bytegrad._src.sharding.rule import split_dim  # noqa: E402

PARTS = 8  # 2 nodes x 4 devices
CHOICES = [("fresh", 8), ("fresh", 4), ("difference", 8), ("difference", 4), ("difference", 2)]


def masters(steps: int, seed: int) -> list[list[jax.Array]]:
    """The split leaves' master weights before each step, and after the last."""
    mesh = jbg.make_mesh(2, 4)
    params = jax.device_get(_llama.init(full_sharding.SHAPE, jax.random.key(seed), scan=True))
    loss = _llama.loss_fn(full_sharding.SHAPE, scan=True, mark="inside")
    kept = []
    with jbg.Strategy("gradient_allreduce", mesh=mesh).train_step(loss, optax.adamw(3e-3)) as step:
        state = step.init(params)
        for batch in full_sharding.batches(steps, seed):
            kept.append(split_leaves(step.params(state)))
            state, _ = step(state, batch)
        kept.append(split_leaves(step.params(state)))
    return kept


def split_leaves(params) -> list[jax.Array]:
    """Every leaf ``shard="full"`` splits, as (devices, block size) float32 rows."""
    rows = []
    for leaf in jax.tree.leaves(params):
        leaf = np.asarray(leaf, np.float32)
        dim = split_dim(leaf.shape, PARTS)
        if dim is not None:
            rows.append(jnp.stack([b.reshape(-1) for b in np.split(leaf, PARTS, axis=dim)]))
    return rows


@functools.partial(jax.jit, static_argnums=(1, 2))
def code(values: jax.Array, bits: int, block: int) -> jax.Array:
    """``values`` (devices, n) coded min-max per block of ``block`` and decoded."""
    codec = Codec(bits=bits, stochastic=False)
    pad = -values.shape[1] % block
    flat = jnp.pad(values, ((0, 0), (0, pad))).reshape(-1, block)
    codes, header = codec.quantize_blocks(flat)
    decoded = codec.dequantize_blocks(codes, header).reshape(values.shape[0], -1)
    return decoded[:, : values.shape[1]]


def errors(trajectory, kind: str, bits: int, block: int) -> list[float]:
    """The relative error of the decoded weights at every step of ``trajectory``."""
    copies = None
    out = []
    for leaves in trajectory:
        if kind == "fresh" or copies is None:
            # The difference codes' first gather has no copy yet: it sends 8-bit codes.
            copies = [code(w, 8 if kind == "difference" else bits, block) for w in leaves]
        else:
            copies = [c + code(w - c, bits, block) for w, c in zip(leaves, copies, strict=True)]
        num = sum(float(jnp.sum((c - w) ** 2)) for c, w in zip(copies, leaves, strict=True))
        den = sum(float(jnp.sum(w**2)) for w in leaves)
        out.append(float(np.sqrt(num / den)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--every", type=int, default=50, help="steps between printed errors")
    args = parser.parse_args()
    block = jbg.SyncConfig().block_size
    trajectory = masters(args.steps, args.seed)
    shown = list(range(0, len(trajectory), args.every))
    print(
        f"JAX {jax.__version__}; 2 x 4 CPU devices; {full_sharding.SHAPE}; {args.steps} steps; "
        f"block {block}"
    )
    print(
        f"{'coding':12s} {'bits':>4s} {'B/weight':>8s} {'median':>9s} {'max':>9s}  "
        + " ".join(f"{'@' + str(i):>8s}" for i in shown)
    )
    for kind, bits in CHOICES:
        found = errors(trajectory, kind, bits, block)
        per_weight = bits / 8 + 8 / block  # codes, and a float32 scale and zero per block
        print(
            f"{kind:12s} {bits:4d} {per_weight:8.4f} {np.median(found[1:]):9.2e} "
            f"{max(found[1:]):9.2e}  " + " ".join(f"{found[i]:8.2e}" for i in shown),
            flush=True,
        )


if __name__ == "__main__":
    main()
