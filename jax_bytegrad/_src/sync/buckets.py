"""Flattening a gradient pytree into flat buckets, and back.

Follows the gradient bucketing of PyTorch DDP and Bagua (Li et al., "PyTorch Distributed",
VLDB 2020): many small leaves become a few large flat buffers, so each collective is large
enough to run at link speed, and several buckets let XLA overlap one bucket's communication
with the next bucket's compute.

Float leaves (float32, bfloat16, float16) are concatenated in tree order, whole leaves per
bucket, in their bucket's dtype (``Layout.bucket_dtypes``: bfloat16 where every leaf of the
bucket is bfloat16, float32 otherwise); each bucket is zero-padded to a multiple of
``granularity`` (devices x block size), so it splits evenly into per-device shards of whole
blocks. Integer and bool leaves are not bucketed: ``from_buckets`` hands them back untouched.

Why bfloat16 buckets stay bfloat16: the bucket's dtype is what its reduce-scatter and
all-gather within the node move, and a bfloat16 user's own all-reduce (``jax.lax.psum``,
PyTorch DDP) sends bfloat16. Summing a node's bfloat16 gradients in bfloat16 adds an error
far below the 8-bit codes' between nodes, and trains as float32 does (benchmarks/RESULTS.md,
"bfloat16"); the gather loses nothing, its leaves being cast to bfloat16 after it. float16
buckets are summed in float32: a node's sum can leave float16's range where its mean would
not.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src import checks


@dataclasses.dataclass(frozen=True)
class Layout:
    """Which float leaves go into which bucket (static, hashable).

    Attributes:
      shapes: shape of every leaf, in tree order.
      dtypes: dtype of every leaf.
      bucketed: whether each leaf is a float leaf that goes into the buckets.
      buckets: for each bucket, the indices of the whole leaves it holds, in order.
      padded_sizes: elements in each bucket after padding to ``granularity``.
      bucket_dtypes: the dtype each bucket is summed and gathered in within the node:
        bfloat16 where all its leaves are bfloat16, float32 otherwise (module docstring).
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[np.dtype, ...]
    bucketed: tuple[bool, ...]
    buckets: tuple[tuple[int, ...], ...]
    padded_sizes: tuple[int, ...]
    bucket_dtypes: tuple[np.dtype, ...]


def make_layout(
    leaves, *, bucket_bytes: int | None, granularity: int, min_leaves: int = 1
) -> Layout:
    """Groups the float leaves (arrays or ShapeDtypeStructs) into buckets of whole leaves.

    A bucket closes when the next leaf would take it past ``bucket_bytes`` of float32, once it
    holds ``min_leaves`` leaves; with one, a leaf larger than that gets a bucket of its own.
    Whole leaves matter on XLA:CPU: a leaf split across two buckets is reassembled by a slow
    concatenate fusion.
    """
    shapes = tuple(tuple(leaf.shape) for leaf in leaves)
    dtypes = tuple(jnp.dtype(leaf.dtype) for leaf in leaves)
    bucketed = tuple(dtype in checks.FLOAT_DTYPES for dtype in dtypes)
    limit = None if bucket_bytes is None else bucket_bytes // 4
    buckets, current, size = [], [], 0
    for i, (shape, is_float) in enumerate(zip(shapes, bucketed, strict=True)):
        n = math.prod(shape)
        if not is_float or n == 0:
            continue
        if len(current) >= min_leaves and limit is not None and size + n > limit:
            buckets.append((tuple(current), size))
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append((tuple(current), size))
    padded = tuple(-(-size // granularity) * granularity for _, size in buckets)
    bf16 = jnp.dtype(jnp.bfloat16)
    bucket_dtypes = tuple(
        bf16 if all(dtypes[i] == bf16 for i in members) else jnp.dtype(jnp.float32)
        for members, _ in buckets
    )
    return Layout(shapes, dtypes, bucketed, tuple(b for b, _ in buckets), padded, bucket_dtypes)


def ready_order(layout: Layout, order: tuple[int, ...] | None = None) -> list[int]:
    """Bucket indices in the order their gradients are complete: by the last leaf of each
    that the backward pass produces, ``order`` being the leaf indices in the order their
    gradients are produced (``steps.tracing.traced_gradient``); or, where that order is not
    known (None), last bucket first, as the backward pass of a model whose parameters are
    listed in forward order produces them (PyTorch DDP's assumption too)."""
    if order is None or sorted(order) != list(range(len(layout.shapes))):
        return list(reversed(range(len(layout.buckets))))
    rank = {leaf: k for k, leaf in enumerate(order)}
    return sorted(range(len(layout.buckets)), key=lambda b: max(rank[i] for i in layout.buckets[b]))


def _bucket(leaves, members, padded: int, dtype) -> jax.Array:
    parts = [leaves[i].reshape(-1).astype(dtype) for i in members]
    size = sum(part.size for part in parts)
    parts.append(jnp.zeros(padded - size, dtype))
    return jnp.concatenate(parts)


def to_buckets(leaves, layout: Layout) -> list[jax.Array]:
    """Concatenates each bucket's leaves as float32, zero-padded to its padded size.

    Float32 whatever ``bucket_dtypes`` says: the pipelined step's buckets, which run on CPUs,
    where XLA:CPU moves bfloat16 collectives as float32 anyway.
    """
    return [
        _bucket(leaves, members, padded, jnp.float32)
        for members, padded in zip(layout.buckets, layout.padded_sizes, strict=True)
    ]


def to_bucket_parts(leaves, layout: Layout, block_size: int) -> list[tuple[jax.Array, ...]]:
    """The buckets, each in its ``bucket_dtypes``, as consecutive parts of whole blocks that
    concatenate to it.

    A bucket of one leaf comes as two parts: the leaf's whole blocks, read where they lie, and
    the rest of it with the padding. XLA:CPU would otherwise copy the whole leaf into the padded
    bucket before reading it (benchmarks/RESULTS.md, "The padded bucket"). Other buckets come
    as one part.
    """
    out = []
    for b, (members, padded) in enumerate(zip(layout.buckets, layout.padded_sizes, strict=True)):
        dtype = layout.bucket_dtypes[b]
        flat = leaves[members[0]].reshape(-1).astype(dtype)
        head = flat.size // block_size * block_size
        if len(members) > 1 or head in (0, padded):
            out.append((_bucket(leaves, members, padded, dtype),))
        else:
            out.append((flat[:head], jnp.pad(flat[head:], (0, padded - flat.size))))
    return out


def _unpack(flat, members, layout: Layout, out: list) -> None:
    """Writes the whole leaves ``members``, laid out one after another in ``flat``, into
    ``out``, in their shapes and dtypes."""
    offset = 0
    for i in members:
        size = math.prod(layout.shapes[i])
        out[i] = flat[offset : offset + size].reshape(layout.shapes[i]).astype(layout.dtypes[i])
        offset += size


def _with_empty_leaves(out: list, layout: Layout) -> list:
    """``out`` with the float leaves of no elements (which no bucket holds) as zeros."""
    for i, (shape, dtype, is_float) in enumerate(
        zip(layout.shapes, layout.dtypes, layout.bucketed, strict=True)
    ):
        if is_float and math.prod(shape) == 0:
            out[i] = jnp.zeros(shape, dtype)
    return out


def from_buckets(buckets, leaves, layout: Layout) -> list:
    """Inverse of ``to_buckets``: float leaves from the buckets, the others from ``leaves``."""
    out = list(leaves)
    for bucket, members in zip(buckets, layout.buckets, strict=True):
        _unpack(bucket, members, layout, out)
    return _with_empty_leaves(out, layout)


def _rows_of(leaf, dim, local: int, dtype) -> jax.Array:
    """A whole leaf as ``local`` rows, flat in ``dtype``: row j its j-th block along ``dim``,
    or (``dim`` None) its j-th equal part, zero-padded."""
    if dim is not None:
        return jnp.moveaxis(leaf, dim, 0).reshape(local, -1).astype(dtype)
    flat = leaf.reshape(-1).astype(dtype)
    per = -(-flat.size // local)
    return jnp.pad(flat, (0, per * local - flat.size)).reshape(local, per)


def _rows(parts, padded: int, local: int) -> jax.Array:
    """A bucket's rows (``parts`` joined along their rows), zero-padded to ``padded // L``
    values each, flat."""
    rows = jnp.concatenate(parts, axis=1)
    return jnp.pad(rows, ((0, 0), (0, padded // local - rows.shape[1]))).reshape(-1)


def _tail_rows(leaves, whole, local: int, dtype) -> jax.Array:
    """The bucket's whole leaves ``whole`` joined, flat, as ``local`` equal rows."""
    tail = jnp.concatenate([leaves[i].reshape(-1).astype(dtype) for i in whole])
    return _rows_of(tail, None, local, dtype)


def to_rows(leaves, layout: Layout, dims, axis: str) -> list[jax.Array]:
    """Each bucket laid out in rows, where the state is split within the node.

    A bucket is laid out as one row per device of ``axis``: row j holds, in the bucket's
    ``bucket_dtypes``, the j-th block of every split leaf (``dims[i]`` the split dimension) and
    the j-th of the equal parts of the bucket's whole leaves (whole leaves first joined, flat),
    then zeros up to ``padded // L``, the length of a device's shard in the replicated layout
    (there is room: the split leaves fill L rows exactly). So the rows cross between nodes as
    the replicated buckets' shards do, with the same sizes and residuals. ``layout`` is the
    whole leaves'.

    Returns, per bucket, all L rows, flat, of each device's whole ``leaves``: for a
    reduce-scatter over ``axis``. ``own_rows`` is this device's row of the node's sums.
    """
    local = int(jax.lax.axis_size(axis))
    out = []
    for b, (members, padded) in enumerate(zip(layout.buckets, layout.padded_sizes, strict=True)):
        dtype = layout.bucket_dtypes[b]
        parts = [_rows_of(leaves[i], dims[i], local, dtype) for i in members if dims[i] is not None]
        whole = [i for i in members if dims[i] is None]
        if whole:
            parts.append(_tail_rows(leaves, whole, local, dtype))
        out.append(_rows(parts, padded, local))
    return out


def own_rows(leaves, layout: Layout, dims, axis: str) -> list[jax.Array]:
    """``to_rows``'s row of this device, from the node's sums: ``leaves`` hold this device's
    blocks of the split leaves (each block flat with its split dimension first, as
    ``to_rows`` lays it) and the whole leaves whole."""
    local = int(jax.lax.axis_size(axis))
    me = jax.lax.axis_index(axis)
    out = []
    for b, (members, padded) in enumerate(zip(layout.buckets, layout.padded_sizes, strict=True)):
        dtype = layout.bucket_dtypes[b]
        parts = [
            jnp.moveaxis(leaves[i], dims[i], 0).reshape(1, -1).astype(dtype)
            for i in members
            if dims[i] is not None
        ]
        whole = [i for i in members if dims[i] is None]
        if whole:
            tail = _tail_rows(leaves, whole, local, dtype)
            parts.append(jax.lax.dynamic_slice_in_dim(tail, me, 1))
        out.append(_rows(parts, padded, local))
    return out


def from_rows(rows, leaves, layout: Layout, dims, axis: str) -> list:
    """Inverse of ``to_rows`` and ``own_rows``: this device's block of each split leaf, and
    each whole leaf gathered over ``axis`` (typed as one value there), from this device's
    reduced rows; leaves outside the buckets from ``leaves``."""
    local = int(jax.lax.axis_size(axis))
    out = list(leaves)
    for b, (row, members) in enumerate(zip(rows, layout.buckets, strict=True)):
        offset = 0
        for i in [i for i in members if dims[i] is not None]:
            shape = list(layout.shapes[i])
            shape[dims[i]] //= local
            block = row[offset : offset + math.prod(shape)]
            moved = [shape[dims[i]], *shape[: dims[i]], *shape[dims[i] + 1 :]]
            out[i] = jnp.moveaxis(block.reshape(moved), 0, dims[i]).astype(layout.dtypes[i])
            offset += math.prod(shape)
        whole = [i for i in members if dims[i] is None]
        if whole:
            total = sum(math.prod(layout.shapes[i]) for i in whole)
            per = -(-total // local)
            # In the bucket's dtype, which the leaves are then cast to: nothing is lost.
            tail = row[offset : offset + per].astype(layout.bucket_dtypes[b])
            tail = jax.lax.all_gather(tail, axis, axis=0, tiled=True, to="invarying")
            _unpack(tail, whole, layout, out)
    return _with_empty_leaves(out, layout)


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
