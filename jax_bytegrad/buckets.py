"""Flattening a gradient pytree into flat float32 buckets, and back.

Follows the gradient bucketing of PyTorch DDP and Bagua (Li et al., "PyTorch Distributed",
VLDB 2020): many small leaves become a few large flat buffers, so each collective is large
enough to run at link speed, and several buckets let XLA overlap one bucket's communication
with the next bucket's compute.

Float leaves (float32, bfloat16, float16) are cast to float32 and concatenated in tree
order; each bucket is zero-padded to a multiple of ``granularity`` (devices x block size),
so it splits evenly into per-device shards of whole blocks. Integer and bool leaves are not
bucketed: ``from_buckets`` hands them back untouched.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each float leaf lives in the buckets (static, hashable).

    Attributes:
      shapes: shape of every leaf, in tree order.
      dtypes: dtype of every leaf.
      bucketed: whether each leaf is a float leaf that goes into the buckets.
      bucket_sizes: unpadded number of elements in each bucket.
      padded_sizes: elements in each bucket after padding to ``granularity``.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    bucketed: tuple[bool, ...]
    bucket_sizes: tuple[int, ...]
    padded_sizes: tuple[int, ...]

    @property
    def num_elements(self) -> int:
        return sum(self.bucket_sizes)


def make_layout(leaves, *, bucket_bytes: int | None, granularity: int) -> Layout:
    """Plans the buckets for a list of leaves (arrays or ShapeDtypeStructs)."""
    shapes = tuple(tuple(leaf.shape) for leaf in leaves)
    dtypes = tuple(jnp.dtype(leaf.dtype) for leaf in leaves)
    bucketed = tuple(dtype in _FLOAT_DTYPES for dtype in dtypes)
    total = sum(math.prod(s) for s, b in zip(shapes, bucketed, strict=True) if b)
    if bucket_bytes is None:
        per_bucket = max(total, 1)
    else:
        # Whole multiples of the granularity, so only the last bucket carries padding.
        per_bucket = max(granularity, bucket_bytes // 4 // granularity * granularity)
    sizes = [min(per_bucket, total - start) for start in range(0, total, per_bucket)]
    padded = [-(-size // granularity) * granularity for size in sizes]
    return Layout(shapes, dtypes, bucketed, tuple(sizes), tuple(padded))


def to_buckets(leaves, layout: Layout) -> list[jax.Array]:
    """Concatenates the float leaves as float32 and cuts them into padded buckets."""
    parts = [
        leaf.astype(jnp.float32).reshape(-1)
        for leaf, bucketed in zip(leaves, layout.bucketed, strict=True)
        if bucketed and leaf.size
    ]
    if not layout.bucket_sizes:
        return []
    flat = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    buckets = []
    start = 0
    for size, padded in zip(layout.bucket_sizes, layout.padded_sizes, strict=True):
        buckets.append(jnp.pad(flat[start : start + size], (0, padded - size)))
        start += size
    return buckets


def from_buckets(buckets, leaves, layout: Layout) -> list:
    """Inverse of ``to_buckets``: float leaves from the buckets, the others from ``leaves``."""
    if buckets:
        parts = [b[:size] for b, size in zip(buckets, layout.bucket_sizes, strict=True)]
        flat = jnp.concatenate(parts) if len(parts) > 1 else parts[0]
    out = []
    start = 0
    for leaf, shape, dtype, bucketed in zip(
        leaves, layout.shapes, layout.dtypes, layout.bucketed, strict=True
    ):
        if not bucketed:
            out.append(leaf)
            continue
        size = math.prod(shape)
        if size == 0:
            out.append(jnp.zeros(shape, dtype))
            continue
        out.append(flat[start : start + size].reshape(shape).astype(dtype))
        start += size
    return out


def flatten_float32(tree) -> jax.Array:
    """All leaves of ``tree`` as one flat float32 vector, in tree order (no padding)."""
    return jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in jax.tree.leaves(tree)])


def unflatten_like(flat: jax.Array, like):
    """Inverse of ``flatten_float32``: a pytree shaped and typed like ``like``."""
    leaves, treedef = jax.tree.flatten(like)
    out, offset = [], 0
    for x in leaves:
        out.append(flat[offset : offset + x.size].reshape(x.shape).astype(x.dtype))
        offset += x.size
    return jax.tree.unflatten(treedef, out)
