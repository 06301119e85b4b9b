"""Gradient means over a ("node", "local") mesh: 8- or 4-bit compressed between nodes, and float32.

Follows Bagua's ByteGrad and GradientAllReduce (Gan et al., "Bagua: Scaling up Distributed
Learning with System Relaxations", VLDB 2022). Everything here runs inside ``jax.shard_map``
on per-device values. The compressed path, per flat bucket:

    psum_scatter over local (float32)      -> this device owns 1/L of its node's sum
    quantize the owned shard as n chunks   -> all_to_all over node (uint8 + headers)
    decode n chunks, weighted sum, encode  -> one fused op, this device's chunk of the mean
    all_gather over node (uint8 + headers) -> decode: the whole owned shard
    all_gather over local (float32)        -> the whole bucket

Codes are 8 bits (Bagua's ByteGrad) or 4 bits packed two per byte (as ZeRO++'s qgZ sends
gradients). With error feedback (as in 1-bit Adam's worker and server errors), each device
keeps what its two compressions failed to send, its share of the node's sum before the
all_to_all and its averaged chunk before the requantize, and adds it to the next step's
value at the same point; ``init_residuals`` sizes that state.

Every device decodes the same codes, so all replicas end bit-identical. No ``psum`` runs
on these codes (they would wrap around; ``wire="allreduce"``, in ``wire.py``, sums codes
made with headroom instead), and no device gathers all n quantized gradients (O(n) memory
and traffic). Unlike Bagua, which funnels a node's traffic through
one leader GPU, all L devices of a node share the inter-node hop.

Inter-node bytes per device: 2 (n-1)/n N/L (codes) plus headers at 8 bits, half that at
4 bits, against 8 (n-1)/n N/L for a float32 ring all-reduce of an N-element gradient.

Error feedback's memory per device, hierarchical: (1 + 1/n) N/L float32 values (N padded to
whole buckets), e.g. 18.9 MB for a 25.2M-parameter model on 2 nodes of 8 devices; flat
(``hierarchical=False``): (1 + 1/(nL)) N.
"""

import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src import buckets as bucketing
from jax_bytegrad._src import checks as _checks
from jax_bytegrad._src.quantization import (
    HEADER_WIDTH,
    Bits,
    Implementation,
    Rounding,
    average_blocks,
    average_requantize,
    check_bits,
    check_block_size,
    check_key,
    check_rounding,
    dequantize_blocks,
    quantize_blocks,
    quantize_with_feedback,
    resolve_implementation,
)

# Big enough that each collective runs at link speed, small enough that a 25M-parameter
# model gets a few buckets whose communication XLA can overlap with the next one's quantize.
DEFAULT_BUCKET_BYTES = 32 * 2**20

# Bytes per message of the exchanges between nodes (codes, per peer). Through XLA's Gloo
# collectives one large message per peer moves at about half the link rate; smaller ones move
# faster, and let each message's quantize and decode run while another is on the wire. 256 KiB
# gave the fastest sync at 2 hosts (benchmarks/RESULTS.md, "Line rate"). None: one per peer.
DEFAULT_MESSAGE_BYTES = 256 * 2**10


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


def scatter_flat(flat: jax.Array, axis, parts: int) -> jax.Array:
    """Sums a flat vector over ``axis``, each device keeping its 1/``parts`` (zero-padded)."""
    flat = jnp.pad(flat, (0, -flat.size % parts))
    return jax.lax.psum_scatter(flat, axis, scatter_dimension=0, tiled=True)


def gather_flat(part: jax.Array, axis, size: int, *, invariant: bool = True) -> jax.Array:
    """Undoes ``scatter_flat``'s split: the ``parts`` gathered over ``axis``, padding dropped.

    With ``invariant`` the result is typed as one value over ``axis``; otherwise it stays
    varying, as per-device state must.
    """
    if invariant:
        return gather_invariant(part, axis)[:size]
    return jax.lax.all_gather(part, axis, axis=0, tiled=True)[:size]


def message_slices(blocks: int, block_bytes: int, message_bytes: int | None) -> list[slice]:
    """Consecutive block ranges of about ``message_bytes`` each (at least one block)."""
    per = blocks if message_bytes is None else max(1, message_bytes // block_bytes)
    return [slice(start, min(start + per, blocks)) for start in range(0, blocks, per)]


def split_ppermute(tree, axis, perm, message_bytes: int | None):
    """``jax.lax.ppermute`` of every leaf of ``tree``, sent in messages of ``message_bytes``.

    The same result as one ``ppermute`` per leaf, bit for bit: only the message size changes.
    """

    def send(x):
        if message_bytes is None or x.size * x.dtype.itemsize <= message_bytes:
            return jax.lax.ppermute(x, axis, perm)
        flat = x.reshape(-1)
        pieces = message_slices(flat.size, x.dtype.itemsize, message_bytes)
        return jnp.concatenate([jax.lax.ppermute(flat[p], axis, perm) for p in pieces]).reshape(
            x.shape
        )

    return jax.tree.map(send, tree)


def _pack(codes: jax.Array, header: jax.Array) -> jax.Array:
    """Each block's codes and header bytes in one uint8 row, so that both go in one message."""
    header_bytes = jax.lax.bitcast_convert_type(header, jnp.uint8)
    return jnp.concatenate([codes, header_bytes.reshape(*header.shape[:-1], -1)], axis=-1)


def _unpack(message: jax.Array, code_bytes: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``_pack``: the codes and the float32 header of each row."""
    header_bytes = message[..., code_bytes:].reshape(*message.shape[:-1], HEADER_WIDTH, 4)
    return message[..., :code_bytes], jax.lax.bitcast_convert_type(header_bytes, jnp.float32)


def _compressed_piece(x, residual, *, group, gather_group, weight, key, codec, all_to_all):
    """The compressed all-reduce of one message's worth of blocks.

    ``x`` has shape (peers, blocks, block_size): row j is what goes to peer j over ``group``,
    which owns those blocks of the mean. The averaged codes come back over ``gather_group``
    (the same devices, possibly named by more axes, which it marks the result replicated
    over). Each block's codes travel with its header, one message per peer and direction.
    Returns the decoded mean of all of ``x``, same shape, and the new residuals: None
    without error feedback, else, for ``residual`` = (send, mean) of shapes ``x.shape`` and
    ``x.shape[1:]``, what each compression left unsent. ``codec`` holds the ``stochastic``,
    ``bits`` and ``implementation`` arguments of the codec's functions.
    """
    peers, blocks, block_size = x.shape
    keys = (None, None) if key is None else jax.random.split(key)
    bits, impl = codec["bits"], codec["implementation"]
    x = x.reshape(peers * blocks, block_size)
    if residual is None:
        codes, header = quantize_blocks(x, key=keys[0], **codec)
    else:
        send, mean = residual
        codes, header, send = quantize_with_feedback(x, send.reshape(x.shape), key=keys[0], **codec)
    code_bytes = codes.shape[-1]
    message = _pack(codes, header).reshape(peers, blocks, -1)
    codes, header = _unpack(all_to_all(message, group), code_bytes)
    if residual is None:
        codes, header = average_requantize(codes, header, weight=weight, key=keys[1], **codec)
    else:
        total = average_blocks(codes, header, weight=weight, bits=bits, implementation=impl)
        codes, header, mean = quantize_with_feedback(total, mean, key=keys[1], **codec)
        residual = (send.reshape(peers, blocks, block_size), mean)
    message = jax.lax.all_gather(_pack(codes, header), gather_group, axis=0, to="invarying")
    codes, header = _unpack(message, code_bytes)
    decoded = dequantize_blocks(
        codes.reshape(peers * blocks, -1),
        header.reshape(peers * blocks, -1),
        bits=bits,
        implementation=impl,
    )
    return decoded.reshape(peers, blocks, block_size), residual


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
    key,
    codec,
    message_bytes,
    residual,
    wire="scatter_gather",
):
    """All-reduce of one flat float32 bucket; its length is a multiple of devices x block.

    Returns the reduced bucket and the new residuals (None without error feedback; see
    ``init_residuals`` for their shapes).

    ``n`` and ``local`` are the sizes of ``node_axis`` and ``local_axis``. Between nodes the
    bucket goes as independent pieces of ``message_bytes`` of codes per peer. XLA runs the
    collectives one at a time, in program order, but a piece's quantize, average and decode
    only wait for their own data, so they can run while other pieces are on the wire, as far
    as free cores allow (docs/performance.md). Blocks are coded independently, so with
    nearest rounding the result does not depend on the split. ``wire="ring"`` sends the
    all_to_all as ppermute shifts (``wire.ring_all_to_all``), with the same result.
    """
    from jax_bytegrad._src import wire as _wire  # wire builds on this module's helpers

    if hierarchical:
        group, group_size = node_axis, n
        if local > 1:
            x = jax.lax.psum_scatter(x, local_axis, scatter_dimension=0, tiled=True)
        # With one device per node, gathering over both axes reaches the same devices and
        # leaves the result replicated: a separate size-1 gather would copy the whole bucket.
        gather_group = node_axis if local > 1 else (node_axis, local_axis)
    else:
        group = gather_group = (node_axis, local_axis)
        group_size = n * local
    if group_size == 1:
        # No slow hop to compress: the honest result is the plain float32 one.
        x = x * jnp.float32(weight)
        if hierarchical:
            # Size-1 gathers move no bytes; they only mark the value as replicated.
            x = gather_invariant(gather_invariant(x, node_axis), local_axis)
    else:
        x = x.reshape(group_size, -1, block_size)
        if residual is not None:
            residual = (residual[0].reshape(x.shape), residual[1].reshape(x.shape[1:]))
        pieces = [
            _compressed_piece(
                x[:, blocks],
                None if residual is None else (residual[0][:, blocks], residual[1][blocks]),
                group=group,
                gather_group=gather_group,
                weight=weight,
                key=None if key is None else jax.random.fold_in(key, i),
                codec=codec,
                all_to_all=_wire.all_to_all(wire, None),
            )
            for i, blocks in enumerate(
                message_slices(x.shape[1], block_size * codec["bits"] // 8, message_bytes)
            )
        ]
        x = jnp.concatenate([decoded for decoded, _ in pieces], axis=1).reshape(-1)
        if residual is not None:
            residual = (
                jnp.concatenate([kept[0] for _, kept in pieces], axis=1).reshape(-1),
                jnp.concatenate([kept[1] for _, kept in pieces], axis=0).reshape(-1),
            )
        if hierarchical and local > 1:
            x = gather_invariant(x, local_axis)
    return x, residual


def residual_sizes(
    tree,
    *,
    num_nodes: int,
    devices_per_node: int,
    hierarchical: bool = True,
    bits: Bits = 8,
    block_size: int | None = None,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    wire: Literal["scatter_gather", "allreduce", "ring"] = "scatter_gather",
) -> tuple[tuple[int, int], ...]:
    """Per-device residual lengths of error feedback, one (send, mean) pair per bucket.

    ``send`` holds what the first compression left unsent: the device's share of its node's
    sum (hierarchical) or of its own bucket (flat); ``mean`` what the requantize of the
    device's averaged chunk left unsent, 1/n (1/(nL) flat) of that. Both are 0 where
    nothing is compressed (one node, hierarchical). With ``wire="allreduce"`` there is one
    compression, so ``mean`` is 0.

    Args:
      tree: the gradient pytree (arrays or ``jax.ShapeDtypeStruct``), as one device has it.
      num_nodes: size of the node axis.
      devices_per_node: size of the local axis.
      hierarchical, bits, block_size, bucket_bytes, wire: as given to ``compressed_mean``.

    Returns:
      One (send, mean) pair of per-device lengths per bucket.

    Raises:
      ValueError: for a bad ``block_size`` or ``wire``.

    Examples:
      >>> import jax.numpy as jnp
      >>> residual_sizes({"w": jnp.ones(1000)}, num_nodes=2, devices_per_node=4, bits=4)
      ((1024, 512),)
      >>> residual_sizes({"w": jnp.ones(1000)}, num_nodes=2, devices_per_node=4,
      ...                wire="allreduce")
      ((2048, 0),)
    """
    from jax_bytegrad._src import wire as _wire  # wire builds on this module's helpers

    _wire.check_wire(wire, "residual_sizes")
    block_size = check_block_size(block_size, "residual_sizes", bits)
    leaves = jax.tree.leaves(tree)
    layout = bucketing.make_layout(
        leaves, bucket_bytes=bucket_bytes, granularity=num_nodes * devices_per_node * block_size
    )
    if wire == "allreduce":
        return _wire.residual_sizes(
            layout.padded_sizes,
            num_nodes=num_nodes,
            devices_per_node=devices_per_node,
            hierarchical=hierarchical,
        )
    group_size = num_nodes if hierarchical else num_nodes * devices_per_node
    sizes = []
    for padded in layout.padded_sizes:
        send = padded // devices_per_node if hierarchical else padded
        sizes.append((0, 0) if group_size == 1 else (send, send // group_size))
    return tuple(sizes)


def init_residuals(tree, **kwargs) -> tuple[tuple[jax.Array, jax.Array], ...]:
    """Zero residuals for ``compressed_mean(..., residuals=...)``, as one device holds them.

    Args:
      tree: the gradient pytree, as one device has it.
      **kwargs: the other arguments of ``residual_sizes``, with the settings that
        ``compressed_mean`` will get.

    Returns:
      One (send, mean) pair of zero float32 vectors per bucket.
    """
    return tuple(
        (jnp.zeros(send, jnp.float32), jnp.zeros(mean, jnp.float32))
        for send, mean in residual_sizes(tree, **kwargs)
    )


def compressed_mean(
    tree,
    *,
    node_axis: str = "node",
    local_axis: str = "local",
    hierarchical: bool = True,
    average: bool = True,
    bits: Bits = 8,
    block_size: int | None = None,
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES,
    message_bytes: int | None = DEFAULT_MESSAGE_BYTES,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    implementation: Implementation | None = None,
    residuals=None,
    wire: Literal["scatter_gather", "allreduce", "ring"] = "scatter_gather",
):
    """Averages a pytree over all devices, 8- or 4-bit compressed between nodes (ByteGrad).

    Call it inside ``jax.shard_map`` on per-device values. Float leaves are bucketed,
    reduced in float32 within a node, exchanged between nodes as block-wise 8- or 4-bit
    codes, and returned in their own dtypes; every device returns bit-identical values.
    With ``residuals`` (error feedback), each compression first adds what it left unsent
    last time, and the new residuals are returned too.

    Args:
      tree: a pytree of per-device arrays. Integer and bool leaves pass through untouched.
      node_axis: mesh axis between nodes (slow links): the compressed hop.
      local_axis: mesh axis within a node (fast links): float32.
      hierarchical: reduce-scatter within the node first (default). With False, the
        compressed exchange runs over both axes as one group, as Bagua's non-hierarchical
        mode does; that sends L times more bytes between nodes.
      average: divide by the total device count (default); False returns the sum.
      bits: bits per code between nodes, 8 or 4.
      block_size: quantization block size (see ``quantize``); None for the default of
        ``bits``.
      bucket_bytes: float32 bytes per bucket; None puts everything in one bucket.
      message_bytes: bytes per message of the exchanges between nodes (codes, per peer);
        None sends one message per peer. Results do not depend on it, only speed does.
      rounding: ``"nearest"`` or ``"stochastic"`` (needs ``key``).
      key: PRNG key for stochastic rounding.
      implementation: quantization kernels to use (see ``quantize``).
      residuals: None (no error feedback), or this device's residuals from
        ``init_residuals`` (same tree structure and settings) or from the previous call.
      wire: how codes cross between nodes. ``"scatter_gather"`` (default): all_to_all to
        each block's owner, which averages and requantizes, then all_gather (ByteGrad).
        ``"allreduce"``: every device quantizes onto a grid the group agrees on (one pmax
        of the block bounds) and the codes are summed by an integer psum, which Gloo runs at
        line rate; fewer levels per device (255 // nodes at 8 bits, uint16 past 8 nodes;
        4 bits up to 2 nodes), one residual (see ``jax_bytegrad._src.wire``). ``"ring"``:
        scatter-gather with the all_to_all as ppermute shifts, the same result.

    Returns:
      A pytree like ``tree`` holding the mean (or sum), typed as replicated over both axes;
      with ``residuals``, the pair (that pytree, the new residuals).

    Raises:
      ValueError: outside ``shard_map``, for an axis name the mesh lacks, for bad ``bits``,
        ``block_size``, ``rounding``, ``key``, ``bucket_bytes``, ``message_bytes`` or
        ``wire``, for 4 bits with ``wire="allreduce"`` over more than 2 nodes, or for
        ``residuals`` that do not fit this tree and mesh.

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
    from jax_bytegrad._src import wire as _wire  # wire builds on this module's helpers

    check_bits(bits, "compressed_mean")
    _wire.check_wire(wire, "compressed_mean")
    block_size = check_block_size(block_size, "compressed_mean", bits)
    stochastic = check_rounding(rounding, "compressed_mean")
    check_key(stochastic, key, "compressed_mean")
    _checks.positive_int(bucket_bytes, "bucket_bytes", "compressed_mean", or_none=True)
    _checks.positive_int(message_bytes, "message_bytes", "compressed_mean", or_none=True)
    codec = dict(
        stochastic=stochastic, bits=bits, implementation=resolve_implementation(implementation)
    )
    n, local = axis_sizes(node_axis, local_axis, "compressed_mean")
    leaves, treedef = jax.tree.flatten(tree)
    layout = bucketing.make_layout(
        leaves, bucket_bytes=bucket_bytes, granularity=n * local * block_size
    )
    if residuals is not None:
        _check_residuals(
            residuals, leaves, n, local, hierarchical, bits, block_size, bucket_bytes, wire
        )
    weight = 1.0 / (n * local) if average else 1.0
    if key is not None:
        # Independent rounding on every device; the result is gathered, so still identical.
        key = jax.random.fold_in(key, jax.lax.axis_index((node_axis, local_axis)))
    if wire == "allreduce":
        sum_flat = _wire.allreduce_sum_flat
    else:
        sum_flat = functools.partial(_compressed_sum_flat, wire=wire)
    reduced, kept = [], []
    for i, bucket in enumerate(bucketing.to_buckets(leaves, layout)):
        bucket, residual = sum_flat(
            bucket,
            node_axis=node_axis,
            local_axis=local_axis,
            n=n,
            local=local,
            hierarchical=hierarchical,
            weight=weight,
            block_size=block_size,
            key=None if key is None else jax.random.fold_in(key, i),
            codec=codec,
            message_bytes=message_bytes,
            residual=None if residuals is None else residuals[i],
        )
        reduced.append(bucket)
        kept.append(residual)
    mean = jax.tree.unflatten(treedef, bucketing.from_buckets(reduced, leaves, layout))
    return mean if residuals is None else (mean, tuple(kept))


def _check_residuals(
    residuals, leaves, n, local, hierarchical, bits, block_size, bucket_bytes, wire
):
    want = residual_sizes(
        leaves,
        num_nodes=n,
        devices_per_node=local,
        hierarchical=hierarchical,
        bits=bits,
        block_size=block_size,
        bucket_bytes=bucket_bytes,
        wire=wire,
    )
    try:
        got = tuple((int(send.size), int(mean.size)) for send, mean in residuals)
    except (TypeError, ValueError, AttributeError):
        got = None
    if got != want:
        raise ValueError(
            f"compressed_mean: residuals of per-device sizes {got} do not fit this tree on a "
            f"{n} x {local} mesh, which needs {want}; build them with init_residuals(...) and "
            "the same settings"
        )


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
        if jnp.dtype(x.dtype) not in _checks.FLOAT_DTYPES:
            return x
        if hierarchical and local > 1 and x.size:
            part = jax.lax.psum(scatter_flat(x.reshape(-1), local_axis, local), node_axis)
            total = gather_flat(part, local_axis, x.size).reshape(x.shape)
        else:
            total = jax.lax.psum(x, (node_axis, local_axis))
        return total / np.asarray(devices, x.dtype) if average else total

    return jax.tree.map(reduce, tree)
