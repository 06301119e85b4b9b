"""Gradient means over a ("node", "local") mesh: 8-bit compressed between nodes, and float32.

Follows Bagua's ByteGrad and GradientAllReduce (Gan et al., "Bagua: Scaling up Distributed
Learning with System Relaxations", VLDB 2022). Everything here runs inside ``jax.shard_map``
on per-device values. The compressed path, per flat bucket:

    psum_scatter over local (float32)      -> this device owns 1/L of its node's sum
    quantize the owned shard as n chunks   -> all_to_all over node (uint8 + headers)
    decode n chunks, weighted sum, encode  -> one fused op, this device's chunk of the mean
    all_gather over node (uint8 + headers) -> decode: the whole owned shard
    all_gather over local (float32)        -> the whole bucket

Every device decodes the same codes, so all replicas end bit-identical. No ``psum`` ever
runs on integer codes (it would wrap around), and no device gathers all n quantized
gradients (O(n) memory and traffic). Unlike Bagua, which funnels a node's traffic through
one leader GPU, all L devices of a node share the inter-node hop.

Inter-node bytes per device: 2 (n-1)/n N/L (codes) plus headers, against 8 (n-1)/n N/L for
a float32 ring all-reduce of an N-element gradient.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad import buckets as bucketing
from jax_bytegrad.quantization import (
    DEFAULT_BLOCK_SIZE,
    Implementation,
    Rounding,
    average_requantize,
    check_block_size,
    check_key,
    check_rounding,
    dequantize_blocks,
    quantize_blocks,
    resolve_implementation,
)

# Big enough that each collective runs at link speed, small enough that a 25M-parameter
# model gets a few buckets whose communication XLA can overlap with the next one's quantize.
DEFAULT_BUCKET_BYTES = 32 * 2**20

# Bytes per message of the exchanges between nodes. Through XLA's Gloo collectives, one large
# message per peer moves at about half the link rate, while messages of about 1 MiB move near
# line rate (benchmarks/RESULTS.md, "Message size"). None sends one message per peer.
DEFAULT_MESSAGE_BYTES = 2**20


def _mesh_axis_names() -> tuple[str, ...]:
    try:
        return tuple(jax.sharding.get_abstract_mesh().axis_names)
    except Exception:  # noqa: BLE001 - only used to word an error message
        return ()


def axis_sizes(node_axis: str, local_axis: str, where: str) -> tuple[int, int]:
    """Sizes of the two mesh axes, with an error that says what to do when one is unbound."""
    sizes = []
    for name, param in ((node_axis, "node_axis"), (local_axis, "local_axis")):
        try:
            sizes.append(int(jax.lax.axis_size(name)))
        except NameError:
            names = _mesh_axis_names()
            if not names:
                raise ValueError(
                    f"{where}: must run inside jax.shard_map over a mesh with axes "
                    f"({node_axis!r}, {local_axis!r}); use jax_bytegrad.data_parallel_step, "
                    "or call it from your own shard_map"
                ) from None
            raise ValueError(
                f"{where}: axis {name!r} is not in the mesh axes {names}; pass {param}=..."
            ) from None
    return sizes[0], sizes[1]


def gather_invariant(x: jax.Array, axis) -> jax.Array:
    """Tiled all_gather whose result is typed as replicated over ``axis`` (one value)."""
    return jax.lax.all_gather(x, axis, axis=0, tiled=True, to="invarying")


def message_slices(blocks: int, block_bytes: int, message_bytes: int | None) -> list[slice]:
    """Consecutive block ranges of about ``message_bytes`` each (at least one block)."""
    per = blocks if message_bytes is None else max(1, message_bytes // block_bytes)
    return [slice(start, min(start + per, blocks)) for start in range(0, blocks, per)]


def _compressed_piece(x, *, group, weight, stochastic, key, impl):
    """The compressed all-reduce of one message's worth of blocks.

    ``x`` has shape (peers, blocks, block_size): row j is what goes to peer j, which owns
    those blocks of the mean. Returns the decoded mean of all of ``x``, same shape.
    """
    peers, blocks, block_size = x.shape
    keys = (None, None) if key is None else jax.random.split(key)
    codes, header = quantize_blocks(
        x.reshape(peers * blocks, block_size),
        stochastic=stochastic,
        key=keys[0],
        implementation=impl,
    )
    codes = jax.lax.all_to_all(codes.reshape(peers, blocks, -1), group, 0, 0, tiled=True)
    header = jax.lax.all_to_all(header.reshape(peers, blocks, -1), group, 0, 0, tiled=True)
    codes, header = average_requantize(
        codes, header, weight=weight, stochastic=stochastic, key=keys[1], implementation=impl
    )
    codes = jax.lax.all_gather(codes, group, axis=0, to="invarying")
    header = jax.lax.all_gather(header, group, axis=0, to="invarying")
    decoded = dequantize_blocks(
        codes.reshape(peers * blocks, -1), header.reshape(peers * blocks, -1), implementation=impl
    )
    return decoded.reshape(x.shape)


def _compressed_sum_flat(
    x,
    *,
    node_axis,
    local_axis,
    n,
    local,
    hierarchical,
    weight,
    block_size,
    stochastic,
    key,
    impl,
    message_bytes,
):
    """All-reduce of one flat float32 bucket; its length is a multiple of devices x block.

    ``n`` and ``local`` are the sizes of ``node_axis`` and ``local_axis``. Between nodes the
    bucket goes as independent pieces of ``message_bytes`` of codes per peer. XLA runs the
    collectives one at a time, in program order, but a piece's quantize, average and decode
    only wait for their own data, so they run while other pieces are on the wire. Blocks are
    coded independently, so with nearest rounding the result does not depend on the split.
    """
    if hierarchical:
        group, group_size = node_axis, n
        if local > 1:
            x = jax.lax.psum_scatter(x, local_axis, scatter_dimension=0, tiled=True)
    else:
        group, group_size = (node_axis, local_axis), n * local
    if group_size == 1:
        # No slow hop to compress: the honest result is the plain float32 one.
        x = x * jnp.float32(weight)
    else:
        x = x.reshape(group_size, -1, block_size)
        pieces = message_slices(x.shape[1], block_size, message_bytes)
        x = jnp.concatenate(
            [
                _compressed_piece(
                    x[:, blocks],
                    group=group,
                    weight=weight,
                    stochastic=stochastic,
                    key=None if key is None else jax.random.fold_in(key, i),
                    impl=impl,
                )
                for i, blocks in enumerate(pieces)
            ],
            axis=1,
        ).reshape(-1)
    if hierarchical:
        # Size-1 gathers move no bytes; they only mark the value as replicated.
        x = gather_invariant(x, node_axis) if group_size == 1 else x
        x = gather_invariant(x, local_axis)
    return x


def compressed_mean(
    tree,
    *,
    node_axis: str = "node",
    local_axis: str = "local",
    hierarchical: bool = True,
    average: bool = True,
    block_size: int = DEFAULT_BLOCK_SIZE,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    message_bytes: int | None = DEFAULT_MESSAGE_BYTES,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    implementation: Implementation | None = None,
):
    """Averages a pytree over all devices, 8-bit compressed between nodes (ByteGrad).

    Call it inside ``jax.shard_map`` on per-device values. Float leaves are bucketed,
    reduced in float32 within a node, exchanged between nodes as block-wise 8-bit codes,
    and returned in their own dtypes; every device returns bit-identical values.

    Args:
      tree: a pytree of per-device arrays. Integer and bool leaves pass through untouched.
      node_axis: mesh axis between nodes (slow links): the compressed hop.
      local_axis: mesh axis within a node (fast links): float32.
      hierarchical: reduce-scatter within the node first (default). With False, the
        compressed exchange runs over both axes as one group, as Bagua's non-hierarchical
        mode does; that sends L times more bytes between nodes.
      average: divide by the total device count (default); False returns the sum.
      block_size: quantization block size (see ``quantize``).
      bucket_bytes: float32 bytes per bucket; None puts everything in one bucket.
      message_bytes: bytes per message of the exchanges between nodes (codes, per peer);
        None sends one message per peer. Results do not depend on it, only speed does.
      rounding: ``"nearest"`` or ``"stochastic"`` (needs ``key``).
      key: PRNG key for stochastic rounding.
      implementation: quantization kernels to use (see ``quantize``).

    Returns:
      A pytree like ``tree`` holding the mean (or sum), typed as replicated over both axes.

    Raises:
      ValueError: outside ``shard_map``, for an axis name the mesh lacks, or for bad
        ``block_size``, ``rounding``, ``key``, ``bucket_bytes`` or ``message_bytes``.

    Examples:
      >>> import jax, jax.numpy as jnp, jax_bytegrad
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> f = jax.shard_map(jax_bytegrad.compressed_mean, mesh=mesh,
      ...                   in_specs=P(), out_specs=P())
      >>> f({"w": jnp.ones(3)})["w"]
      Array([1., 1., 1.], dtype=float32)

    References:
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    check_block_size(block_size, "compressed_mean")
    stochastic = check_rounding(rounding, "compressed_mean")
    check_key(stochastic, key, "compressed_mean")
    check_size_bytes(bucket_bytes, "bucket_bytes", "compressed_mean")
    check_size_bytes(message_bytes, "message_bytes", "compressed_mean")
    impl = resolve_implementation(implementation)
    n, local = axis_sizes(node_axis, local_axis, "compressed_mean")
    leaves, treedef = jax.tree.flatten(tree)
    layout = bucketing.make_layout(
        leaves, bucket_bytes=bucket_bytes, granularity=n * local * block_size
    )
    weight = 1.0 / (n * local) if average else 1.0
    if key is not None:
        # Independent rounding on every device; the result is gathered, so still identical.
        key = jax.random.fold_in(key, jax.lax.axis_index((node_axis, local_axis)))
    reduced = []
    for i, bucket in enumerate(bucketing.to_buckets(leaves, layout)):
        reduced.append(
            _compressed_sum_flat(
                bucket,
                node_axis=node_axis,
                local_axis=local_axis,
                n=n,
                local=local,
                hierarchical=hierarchical,
                weight=weight,
                block_size=block_size,
                stochastic=stochastic,
                key=None if key is None else jax.random.fold_in(key, i),
                impl=impl,
                message_bytes=message_bytes,
            )
        )
    return jax.tree.unflatten(treedef, bucketing.from_buckets(reduced, leaves, layout))


def full_precision_mean(
    tree,
    *,
    node_axis: str = "node",
    local_axis: str = "local",
    hierarchical: bool = False,
    average: bool = True,
):
    """Averages a pytree over all devices in its own dtype, uncompressed (GradientAllReduce).

    With ``hierarchical=True`` each leaf is reduce-scattered within the node, all-reduced
    between nodes and gathered within the node, so each device sends 1/L of the bytes
    between nodes; otherwise one all-reduce spans both axes. Integer and bool leaves pass
    through untouched. Call it inside ``jax.shard_map``.
    """
    n, local = axis_sizes(node_axis, local_axis, "full_precision_mean")
    devices = n * local

    def reduce(x):
        if jnp.dtype(x.dtype) not in bucketing._FLOAT_DTYPES:
            return x
        if hierarchical and local > 1 and x.size:
            flat = x.reshape(-1)
            pad = -flat.size % local
            flat = jnp.pad(flat, (0, pad))
            part = jax.lax.psum_scatter(flat, local_axis, scatter_dimension=0, tiled=True)
            part = jax.lax.psum(part, node_axis)
            flat = gather_invariant(part, local_axis)
            total = flat[: x.size].reshape(x.shape)
        else:
            total = jax.lax.psum(x, (node_axis, local_axis))
        return total / np.asarray(devices, x.dtype) if average else total

    return jax.tree.map(reduce, tree)


def check_size_bytes(value, name: str, where: str) -> None:
    """A byte count (``bucket_bytes``, ``message_bytes``) must be a positive int or None."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"{where}: {name} must be a positive int or None, got {value!r}")
