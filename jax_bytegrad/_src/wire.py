"""The wires between nodes: how one flat float32 bucket's codes are summed over the mesh.

Each wire is written once, as stages between its collectives: the one-program step runs them
inline (``sum_flat``), the pipelined step runs each stage as a program of its own.

``wire="scatter_gather"`` is Bagua's ByteGrad (Gan et al., VLDB 2022), per flat bucket:

    psum_scatter over local (float32)      -> this device owns 1/L of its node's sum
    quantize the owned shard as n chunks   -> all_to_all over node (uint8 + headers)
    decode n chunks, weighted sum, encode  -> one fused op, this device's chunk of the mean
    all_gather over node (uint8 + headers) -> decode: the whole owned shard
    all_gather over local (float32)        -> the whole bucket

No device gathers all n quantized gradients, and, unlike Bagua, which funnels a node's
traffic through one leader GPU, all L devices of a node share the inter-node hop: 2 (n-1)/n N/L
bytes of codes per device (plus headers) at 8 bits, half that at 4, against 8 (n-1)/n N/L for a
float32 ring all-reduce. With error feedback each device keeps what its two compressions left
unsent.

Through Gloo on CPU hosts, pairwise exchanges reach only part of a link while an all-reduce
runs at line rate (benchmarks/RESULTS.md, "Integer wire and rings"), hence the two others:

``wire="allreduce"``: every device of the group that sums (the nodes, or every device with
``hierarchical=False``) quantizes onto a grid the group agrees on, with headroom, so the codes
add up in one integer ``psum`` (the codec and its semantics: ``codecs/integer.py``):

    psum_scatter over local (float32)      -> this device owns 1/L of its node's sum
    block bounds [max, -min], one pmax     -> every device has the same grid per block
    quantize onto the grid (L levels)      -> uint8 (or uint16) codes, g * L <= 2**bits - 1
    psum over the group (integers)         -> cannot overflow: headroom
    decode factors per block, one pmax     -> the same on every device
    decode the sum                         -> the same integers, the same float ops
    all_gather over local (float32)        -> the whole bucket

``wire="ring"``: the scatter-gather wire with its all_to_all done as g - 1 ppermute shifts
(``collective_ops.ring_all_to_all``). Same codes, same result, bit for bit.

The bytes each wire sends between nodes: benchmarks/RESULTS.md, "Bytes between nodes" and
"Decode factors: each block's grid once, not once per value".
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src.codecs import integer
from jax_bytegrad._src.collective_ops import gather_invariant, message_slices, ring_all_to_all
from jax_bytegrad._src.config import Codec, SyncConfig, Wire
from jax_bytegrad._src.quantization import (
    HEADER_WIDTH,
    average_blocks,
    average_requantize,
    dequantize_blocks,
    quantize_blocks,
    quantize_with_feedback,
)


def code_exchange(wire: Wire, message_bytes: int | None):
    """The all_to_all of the scatter-gather wire's codes, ``(x, axis) -> received``."""
    if wire == "ring":
        return lambda x, axis: ring_all_to_all(x, axis, message_bytes=message_bytes)
    return lambda x, axis: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


# The scatter-gather wire ------------------------------------------------------------------------


def _pack(codes: jax.Array, header: jax.Array) -> jax.Array:
    """Each block's codes and header bytes in one uint8 row, so that both go in one message."""
    header_bytes = jax.lax.bitcast_convert_type(header, jnp.uint8)
    return jnp.concatenate([codes, header_bytes.reshape(*header.shape[:-1], -1)], axis=-1)


def _unpack(message: jax.Array, code_bytes: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``_pack``: the codes and the float32 header of each row."""
    header_bytes = message[..., code_bytes:].reshape(*message.shape[:-1], HEADER_WIDTH, 4)
    return message[..., :code_bytes], jax.lax.bitcast_convert_type(header_bytes, jnp.float32)


def _arguments(codec: Codec) -> dict:
    """The keyword arguments of the quantization functions that encode, from ``codec``."""
    return dict(stochastic=codec.stochastic, bits=codec.bits, implementation=codec.implementation)


def _piece_keys(key):
    """The two rounding keys of one message piece (its quantize and its requantize)."""
    return (None, None) if key is None else jax.random.split(key)


def sg_encode(x, send, *, key, codec: Codec):
    """The scatter-gather wire's first stage: quantize one piece for its owners.

    ``x`` (and error feedback's ``send`` residual, or None) has shape (peers, blocks,
    block_size): row j goes to peer j. Returns the message, each block's codes with its
    header in one uint8 row, shape (peers, blocks, bytes), and the new ``send`` residual.
    ``codec`` is the config's ``Codec``; ``key`` is the piece's key (None for nearest
    rounding).
    """
    peers, blocks, block_size = x.shape
    x = x.reshape(peers * blocks, block_size)
    key = _piece_keys(key)[0]
    if send is None:
        codes, header = quantize_blocks(x, key=key, **_arguments(codec))
    else:
        send = send.reshape(x.shape)
        codes, header, send = quantize_with_feedback(x, send, key=key, **_arguments(codec))
        send = send.reshape(peers, blocks, block_size)
    return _pack(codes, header).reshape(peers, blocks, -1), send


def sg_average(received, mean, *, weight, key, codec: Codec, block_size):
    """The second stage: average the received pieces and requantize this device's chunk.

    ``received`` is the all_to_all of ``sg_encode``'s messages, (peers, blocks, bytes);
    ``mean`` error feedback's residual of the requantize, (blocks, block_size), or None.
    Returns the message to gather, (blocks, bytes), and the new ``mean`` residual.
    """
    codes, header = _unpack(received, block_size * codec.bits // 8)
    key = _piece_keys(key)[1]
    if mean is None:
        codes, header = average_requantize(
            codes, header, weight=weight, key=key, **_arguments(codec)
        )
    else:
        total = average_blocks(
            codes, header, weight=weight, bits=codec.bits, implementation=codec.implementation
        )
        codes, header, mean = quantize_with_feedback(total, mean, key=key, **_arguments(codec))
    return _pack(codes, header), mean


def sg_decode(gathered, *, codec: Codec, block_size):
    """The last stage: decode the gathered averages, (peers, blocks, bytes), to float32
    values of shape (peers, blocks, block_size)."""
    peers, blocks = gathered.shape[:2]
    codes, header = _unpack(gathered, block_size * codec.bits // 8)
    decoded = dequantize_blocks(
        codes.reshape(peers * blocks, -1),
        header.reshape(peers * blocks, -1),
        bits=codec.bits,
        implementation=codec.implementation,
    )
    return decoded.reshape(peers, blocks, block_size)


def _scatter_gather_piece(x, residual, *, group, gather_group, weight, key, codec, all_to_all):
    """The compressed all-reduce of one message's worth of blocks.

    ``x`` has shape (peers, blocks, block_size): row j is what goes to peer j over ``group``,
    which owns those blocks of the mean. The averaged codes come back over ``gather_group``
    (the same devices, possibly named by more axes, which it marks the result replicated
    over). Each block's codes travel with its header, one message per peer and direction.
    Returns the decoded mean of all of ``x``, same shape, and the new residuals: None
    without error feedback, else, for ``residual`` = (send, mean) of shapes ``x.shape`` and
    ``x.shape[1:]``, what each compression left unsent. The stages between the collectives
    (``sg_encode``, ``sg_average``, ``sg_decode``) are also what the pipelined step runs as
    programs of their own.
    """
    block_size = x.shape[-1]
    send, mean = (None, None) if residual is None else residual
    message, send = sg_encode(x, send, key=key, codec=codec)
    message, mean = sg_average(
        all_to_all(message, group),
        mean,
        weight=weight,
        key=key,
        codec=codec,
        block_size=block_size,
    )
    gathered = jax.lax.all_gather(message, gather_group, axis=0, to="invarying")
    decoded = sg_decode(gathered, codec=codec, block_size=block_size)
    return decoded, None if residual is None else (send, mean)


def scatter_gather_sum_flat(x, config: SyncConfig, *, n, local, weight, key, residual):
    """All-reduce of one flat float32 bucket; its length is a multiple of devices x block.

    Returns ``sum_shard``'s shard and the new residuals (None without error feedback; see
    ``residual_sizes`` for their shapes).

    ``n`` and ``local`` are the sizes of the node and local axes. Between nodes the
    bucket goes as independent pieces of ``message_bytes`` of codes per peer. XLA runs the
    collectives one at a time, in program order, but a piece's quantize, average and decode
    only wait for their own data, so they can run while other pieces are on the wire, as far
    as free cores allow (docs/performance.md). Blocks are coded independently, so with
    nearest rounding the result does not depend on the split. ``wire="ring"`` sends the
    all_to_all as ppermute shifts (``ring_all_to_all``), with the same result.
    """
    node_axis, local_axis = config.axes
    block_size, hierarchical = config.block_size, config.hierarchical
    exchange = code_exchange(config.wire, config.message_bytes)
    group_size = config.group_size(n, local)
    if hierarchical:
        group = node_axis
        if local > 1:
            x = jax.lax.psum_scatter(x, local_axis, scatter_dimension=0, tiled=True)
        # With one device per node, gathering over both axes reaches the same devices and
        # leaves the result replicated: a separate size-1 gather would copy the whole bucket.
        gather_group = node_axis if local > 1 else (node_axis, local_axis)
    else:
        group = gather_group = (node_axis, local_axis)
    if group_size == 1:
        # No slow hop to compress: the honest result is the plain float32 one.
        x = x * jnp.float32(weight)
        if hierarchical:
            x = _plain_shard(x, node_axis, local_axis, local)
    else:
        x = x.reshape(group_size, -1, block_size)
        if residual is not None:
            residual = (residual[0].reshape(x.shape), residual[1].reshape(x.shape[1:]))
        pieces = [
            _scatter_gather_piece(
                x[:, blocks],
                None if residual is None else (residual[0][:, blocks], residual[1][blocks]),
                group=group,
                gather_group=gather_group,
                weight=weight,
                key=None if key is None else jax.random.fold_in(key, i),
                codec=config.codec,
                all_to_all=exchange,
            )
            for i, blocks in enumerate(
                message_slices(x.shape[1], block_size * config.bits // 8, config.message_bytes)
            )
        ]
        x = jnp.concatenate([decoded for decoded, _ in pieces], axis=1).reshape(-1)
        if residual is not None:
            residual = (
                jnp.concatenate([kept[0] for _, kept in pieces], axis=1).reshape(-1),
                jnp.concatenate([kept[1] for _, kept in pieces], axis=0).reshape(-1),
            )
    return x, residual


# The integer wire ---------------------------------------------------------------------------


def integer_sum(
    x: jax.Array,
    residual: jax.Array | None,
    *,
    group,
    group_size: int,
    weight: float,
    block_size: int,
    key: jax.Array | None,
    bits: int,
    stochastic: bool,
) -> tuple[jax.Array, jax.Array | None]:
    """``weight`` times the sum over ``group`` of the flat vectors ``x``, as integer codes.

    One psum per call: an all-reduce cut into messages only runs slower through Gloo
    (benchmarks/RESULTS.md, "Integer wire and rings"), so the bucket is the message. The
    stages between the collectives (``integer_bounds``, ``integer_encode``,
    ``decode_factors``, ``integer_decode``) are also what the pipelined step runs as programs
    of their own.

    Args:
      x: this device's flat float32 vector, or a tuple of consecutive parts of it
        (``buckets.to_bucket_parts``); each a whole number of blocks.
      residual: None, or this device's error-feedback residual, as long as ``x``.
      group: the axis name (or names) that sums.
      group_size: its size.
      weight: scales the decoded sum (1 / devices for a mean).
      block_size: values per grid.
      key: this device's PRNG key for stochastic rounding (None for nearest).
      bits: 8 or 4 (see ``allreduce_width``).
      stochastic: stochastic rounding.

    Returns:
      The decoded weighted sum, typed as replicated over ``group``, and the new residual
      (None without one).
    """
    width = integer.allreduce_width(bits, group_size)
    parts = x if isinstance(x, tuple) else (x,)
    starts = np.cumsum([0, *(part.shape[0] for part in parts)]).tolist()
    if residual is not None:
        parts = [p + residual[s:e] for p, s, e in zip(parts, starts[:-1], starts[1:], strict=True)]
    bounds = jnp.concatenate([integer.integer_bounds(part, block_size) for part in parts])
    bounds = jax.lax.pmax(bounds, group)
    seed = None if key is None else integer.dither_seed(key)
    encoded = []
    for part, start, stop in zip(parts, starts[:-1], starts[1:], strict=True):
        first, last = start // block_size, stop // block_size
        encoded.append(
            integer.integer_encode(
                part, bounds[first:last], block_size=block_size, width=width,
                stochastic=stochastic, seed=seed, first_block=first, feedback=residual is not None,
            )
        )  # fmt: skip
    codes = jnp.concatenate([c for c, _ in encoded])
    kept = None if residual is None else jnp.concatenate([k for _, k in encoded])
    total = jax.lax.psum(codes, group)
    factors = integer.decode_factors(
        bounds, width=width, group_size=group_size, weight=weight, stochastic=stochastic
    )
    # The same on every device: the pmax changes no bit (module docstring).
    factors = jax.lax.pmax(factors, group)
    return integer.integer_decode(total, factors, width=width), kept


def allreduce_sum_flat(x, config: SyncConfig, *, n, local, weight, key, residual):
    """The integer wire's all-reduce of one flat float32 bucket (``sum_shard``'s
    contract): its length a multiple of devices x block; returns ``sum_shard``'s shard and
    the new residuals, None without error feedback, else
    (send, mean) with ``mean`` empty (one compression, so one residual; ``residual_sizes``).
    ``config.implementation`` is not used: this codec is jnp, which XLA fuses on every
    backend.
    """
    node_axis, local_axis = config.axes
    hierarchical = config.hierarchical
    group_size = config.group_size(n, local)
    if hierarchical:
        if local > 1:
            x = jax.lax.psum_scatter(_joined(x), local_axis, scatter_dimension=0, tiled=True)
        # With one device per node, summing over both axes reaches the same devices and
        # types the result replicated over both.
        group = node_axis if local > 1 else (node_axis, local_axis)
    else:
        group = (node_axis, local_axis)
    if group_size == 1:
        # No slow hop to compress: the honest result is the plain float32 one.
        x = _joined(x) * jnp.float32(weight)
        if hierarchical:
            x = _plain_shard(x, node_axis, local_axis, local)
        return x, residual
    _warn_if_promoted(config.bits, group_size)
    send = None if residual is None else residual[0]
    x, send = integer_sum(
        x,
        send,
        group=group,
        group_size=group_size,
        weight=weight,
        block_size=config.block_size,
        key=key,
        bits=config.bits,
        stochastic=config.stochastic,
    )
    return x, None if residual is None else (send, residual[1])


_WARNED_PROMOTION: set[int] = set()


def _traced_platform() -> str:
    """The platform of the mesh being traced: the abstract mesh's device (JAX >= 0.11 knows
    it inside ``shard_map``, deviceless meshes included), else the default backend."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def _warn_if_promoted(bits: int, group_size: int) -> None:
    """Warns, once per group size, when the integer wire's codes go as uint16 on a GPU:
    XLA:GPU promotes 16-bit integer all-reduces to 32 bits, float32's bytes."""
    width = integer.allreduce_width(bits, group_size)
    if width.bits != 16 or _traced_platform() != "gpu" or group_size in _WARNED_PROMOTION:
        return
    _WARNED_PROMOTION.add(group_size)
    warnings.warn(
        f"jax_bytegrad: wire='allreduce' sums the codes of {group_size} devices as uint16 "
        "(more than 8 summing devices), and XLA:GPU promotes 16-bit integer all-reduces to "
        "32 bits: this sync costs as many bytes as a float32 all-reduce here. Pass "
        "wire='scatter_gather' (8-bit codes at any group size), or hierarchical=True with at "
        "most 8 nodes",
        RuntimeWarning,
        stacklevel=2,
    )


def _plain_shard(x, node_axis, local_axis, local: int) -> jax.Array:
    """A shard summed by nobody else (one node), typed as the wires' shards are: replicated
    over the node axis, and over the local one where no gather within the node follows.
    Size-1 gathers move no bytes; they only mark the value as replicated."""
    x = gather_invariant(x, node_axis)
    return gather_invariant(x, local_axis) if local == 1 else x


def _joined(x) -> jax.Array:
    """A bucket given whole or as its parts (``buckets.to_bucket_parts``), as one vector."""
    return jnp.concatenate(x) if isinstance(x, tuple) else x


def sum_shard(x, config: SyncConfig, *, n, local, weight, key, residual):
    """The part of a flat float32 bucket's all-reduce that crosses between nodes, over
    ``config``'s wire; the bucket's length is a multiple of devices x block. ``x`` may come
    as a tuple of its parts: the integer wire reads them where they lie, the others join
    them.

    Returns this device's shard of the reduced bucket (all of it without a reduce-scatter
    within the node), typed as replicated over the devices that summed it, and the new
    residuals (None without error feedback; ``residual_sizes``). ``gather_shard`` makes it
    the whole bucket.
    """
    allreduce = config.wire_for(config.group_size(n, local)) == "allreduce"
    if not allreduce:
        return scatter_gather_sum_flat(
            _joined(x), config, n=n, local=local, weight=weight, key=key, residual=residual
        )
    return allreduce_sum_flat(
        x, config, n=n, local=local, weight=weight, key=key, residual=residual
    )


def gather_shard(shard: jax.Array, config: SyncConfig, local: int) -> jax.Array:
    """``sum_shard``'s shard as the whole reduced bucket, typed as replicated over both
    axes: a float32 all_gather within the node after a reduce-scatter there."""
    if config.hierarchical and local > 1:
        return gather_invariant(shard, config.local_axis)
    return shard


def sum_flat(x, config: SyncConfig, *, n, local, weight, key, residual):
    """The all-reduce of one flat float32 bucket: ``sum_shard`` then ``gather_shard``.
    Returns the reduced bucket, typed as replicated over both axes, and the new residuals."""
    shard, residual = sum_shard(
        x, config, n=n, local=local, weight=weight, key=key, residual=residual
    )
    return gather_shard(shard, config, local), residual


def residual_sizes(padded_sizes, config: SyncConfig, mesh_shape: tuple[int, int]) -> tuple:
    """Per-device (send, mean) residual lengths, one pair per bucket of the given padded sizes.

    The scatter-gather wires keep two: ``send``, what the first compression left unsent (the
    device's share of its node's sum, hierarchical, or of its own bucket, flat), and
    ``mean``, what the requantize of its averaged chunk left unsent, 1/g of that. The
    integer wire keeps one, what this device's codes missed, and an empty ``mean``. Both are
    0 where nothing is compressed (one node, hierarchical).
    """
    nodes, per_node = mesh_shape
    group_size = config.group_size(nodes, per_node)
    one_residual = config.wire_for(group_size) == "allreduce"
    sizes = []
    for padded in padded_sizes:
        send = padded // per_node if config.hierarchical else padded
        if group_size == 1:
            sizes.append((0, 0))
        else:
            sizes.append((send, 0 if one_residual else send // group_size))
    return tuple(sizes)
