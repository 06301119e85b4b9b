"""The wires between nodes: how one flat float32 bucket's codes are summed over the mesh.

Each wire is written once, as a plan: the stages of one piece of a bucket between its
collectives (``integer_plan``, ``scatter_gather_plan``). The one-program step runs the plan
inline (``sum_flat``, through ``run``); the pipelined step runs each stage as a program of its
own (``steps/stages.py``); the GPU schedule tests count its collectives per bucket.

``wire="scatter_gather"`` is Bagua's ByteGrad (Gan et al., VLDB 2022), per flat bucket:

    psum_scatter over local (bucket dtype) -> this device owns 1/L of its node's sum
    quantize the owned shard as n chunks   -> all_to_all over node (uint8 + headers)
    decode n chunks, weighted sum, encode  -> one fused op, this device's chunk of the mean
    all_gather over node (uint8 + headers) -> decode: the whole owned shard
    all_gather over local (bucket dtype)   -> the whole bucket

The bucket's dtype within the node is float32, or bfloat16 for a bucket of bfloat16 leaves
(``buckets.Layout.bucket_dtype``); the codecs read and write float32.

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

    psum_scatter over local (bucket dtype) -> this device owns 1/L of its node's sum
    block bounds [max, -min], one pmax     -> every device has the same grid per block
    quantize onto the grid (L levels)      -> uint8 (or uint16) codes, g * L <= 2**bits - 1
    psum over the group (integers)         -> cannot overflow: headroom
    decode factors per block, one pmax     -> the same on every device
    decode the sum                         -> the same integers, the same float ops
    all_gather over local (bucket dtype)   -> the whole bucket

``wire="ring"``: the scatter-gather wire with its all_to_all done as g - 1 ppermute shifts
(``collective_ops.ring_all_to_all``). Same codes, same result, bit for bit.

The bytes each wire sends between nodes: benchmarks/RESULTS.md, "Bytes between nodes" and
"Decode factors: each block's grid once, not once per value".
"""

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src import codecs
from jax_bytegrad._src.codecs import Codec, integer
from jax_bytegrad._src.collective_ops import gather_invariant, message_slices, ring_all_to_all
from jax_bytegrad._src.config import SyncConfig, Wire, platform_of
from jax_bytegrad._src.quantization import HEADER_WIDTH, average_blocks, quantize_with_feedback


def code_exchange(wire: Wire, message_bytes: int | None):
    """The all_to_all of the scatter-gather wire's codes, ``(x, axis) -> received``."""
    if wire == "ring":
        return lambda x, axis: ring_all_to_all(x, axis, message_bytes=message_bytes)
    return lambda x, axis: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


# Who compresses with whom, and a wire's stages ---------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Group:
    """The devices that compress together: one device per node (hierarchical, after a
    float32 reduce-scatter within the node), or every device.

    Attributes:
      axis: the axes the codes are exchanged or summed over.
      gather: the scatter-gather wire's all_gather axes (the same devices).
      size: devices in the group.
      scatter: whether a float32 reduce-scatter within the node comes first (and an
        all_gather there last).
      wire: the wire that runs between them (``"auto"`` resolved).
    """

    axis: Any
    gather: Any
    size: int
    scatter: bool
    wire: Wire

    @property
    def plain(self) -> bool:
        """One device in the group: nothing is compressed."""
        return self.size == 1


def group_of(config: SyncConfig, n: int, local: int) -> Group:
    """The group of a ``n`` x ``local`` mesh under ``config``."""
    size = config.group_size(n, local)
    wire = config.wire_for(size)
    axes = config.axes
    if not config.hierarchical:
        return Group(axes, axes, size, False, wire)
    # With one device per node, the integer sum over both axes types its result replicated
    # over both; the scatter-gather wire gathers over both for the same reason: a size-1
    # gather would copy the whole bucket.
    summed = config.node_axis if local > 1 or wire != "allreduce" else axes
    return Group(summed, config.node_axis if local > 1 else axes, size, local > 1, wire)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a piece's way between nodes, as a function of named values.

    A wire's plan is the tuple of its stages for one piece of a bucket. The one-program sync
    runs it inline (``run``); the pipelined step runs each stage as a program of its own
    (``steps/stages.py``); both read the same functions, so the bits are the same.

    Attributes:
      name: what it does (``"encode"``, ``"psum"``, ...), which also names its output.
      kind: ``"compute"`` (on the device) or ``"wire"`` (collectives only).
      fn: takes the values named by ``chains`` and then by ``reads``; returns the new values
        of ``chains`` and then its output.
      reads: the values it reads: earlier stages' outputs by name, or the bucket's
        ``"x"`` (what the group compresses), ``"key"`` (the bucket's key, or None),
        ``"agreed"`` and ``"factors"`` (the integer wire's agreed bounds and decode factors).
      chains: the error-feedback residuals it updates (``"send"``, ``"mean"``); empty
        without error feedback.
    """

    name: str
    kind: str
    fn: Callable
    reads: tuple[str, ...]
    chains: tuple[str, ...] = ()


def run(plan: tuple[Stage, ...], values: dict) -> dict:
    """Runs ``plan`` in the calling program: ``values`` with every stage's output (and
    updated residuals) added under its name."""
    values = dict(values)
    for stage in plan:
        outs = stage.fn(*(values[name] for name in (*stage.chains, *stage.reads)))
        values.update(zip((*stage.chains, stage.name), outs, strict=True))
    return values


# The scatter-gather wire ------------------------------------------------------------------------


def _pack(codes: jax.Array, header: jax.Array) -> jax.Array:
    """Each block's codes and header bytes in one uint8 row, so that both go in one message."""
    header_bytes = jax.lax.bitcast_convert_type(header, jnp.uint8)
    return jnp.concatenate([codes, header_bytes.reshape(*header.shape[:-1], -1)], axis=-1)


def _unpack(message: jax.Array, code_bytes: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``_pack``: the codes and the float32 header of each row."""
    header_bytes = message[..., code_bytes:].reshape(*message.shape[:-1], HEADER_WIDTH, 4)
    return message[..., :code_bytes], jax.lax.bitcast_convert_type(header_bytes, jnp.float32)


def _piece_keys(key):
    """The two rounding keys of one message piece (its quantize and its requantize)."""
    return (None, None) if key is None else jax.random.split(key)


def sg_encode(x, send, *, key, codec: Codec):
    """The scatter-gather wire's first stage: quantize one piece for its owners.

    ``x`` (and error feedback's ``send`` residual, or None) has shape (peers, blocks,
    block_size): row j goes to peer j. Returns the message, each block's codes with its
    header in one uint8 row, shape (peers, blocks, bytes), and the new ``send`` residual.
    ``codec`` is the config's ``codecs.Codec``; ``key`` is the piece's key (None for nearest
    rounding).
    """
    peers, blocks, block_size = x.shape
    x = x.reshape(peers * blocks, block_size)
    key = _piece_keys(key)[0]
    if send is None:
        codes, header = codecs.quantize_blocks(codec, x, key)
    else:
        send = send.reshape(x.shape)
        codes, header, send = quantize_with_feedback(codec, x, send, key)
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
        codes, header = codecs.average_requantize(codec, codes, header, key, weight=weight)
    else:
        total = average_blocks(codec, codes, header, weight=weight)
        codes, header, mean = quantize_with_feedback(codec, total, mean, key)
    return _pack(codes, header), mean


def sg_decode(gathered, *, codec: Codec, block_size):
    """The last stage: decode the gathered averages, (peers, blocks, bytes), to float32
    values of shape (peers, blocks, block_size)."""
    peers, blocks = gathered.shape[:2]
    codes, header = _unpack(gathered, block_size * codec.bits // 8)
    decoded = codecs.dequantize_blocks(
        codec, codes.reshape(peers * blocks, -1), header.reshape(peers * blocks, -1)
    )
    return decoded.reshape(peers, blocks, block_size)


def scatter_gather_plan(config: SyncConfig, group: Group, *, weight, held, feedback: bool):
    """The scatter-gather wire's stages for some message pieces of a bucket.

    quantize -> all_to_all -> average -> all_gather -> decode. ``held`` is a tuple of
    consecutive (index in the bucket, block slice) pairs, each a piece of ``message_bytes``
    of codes per peer (``message_slices``): each piece is a message of its own in each
    exchange, and rounds with the bucket's key folded with its index. Each block's codes
    travel with its header, one message per peer and direction, and no device gathers all
    the group's codes.

    The plan reads ``x``, the group's vector of the bucket (row j of its (peers, blocks,
    block) view goes to peer j, which owns those blocks of the mean), and ``key``; with
    ``feedback`` it updates ``send`` (what the first compression left unsent, as long as
    ``x``) and ``mean`` (what the requantize left unsent, 1/peers of that). Its ``decode``
    is the held blocks of the mean, shaped (peers, held blocks, block).
    """
    codec, block = config.codec, config.block_size
    exchange = code_exchange(group.wire, config.message_bytes)
    span = slice(held[0][1].start, held[-1][1].stop)

    def key_of(key, j):
        return None if key is None else jax.random.fold_in(key, j)

    def quantize(*args):
        *send, x, key = args
        x = x.reshape(group.size, -1, block)
        send = send[0].reshape(x.shape) if send else None
        messages, kept = [], []
        for j, blocks in held:
            part = None if send is None else send[:, blocks]
            message, new = sg_encode(x[:, blocks], part, key=key_of(key, j), codec=codec)
            messages.append(message)
            kept.append(new)
        if send is None:
            return (tuple(messages),)
        return send.at[:, span].set(jnp.concatenate(kept, axis=1)).reshape(-1), tuple(messages)

    def all_to_all(messages):
        return (tuple(exchange(m, group.axis) for m in messages),)

    def average(*args):
        *mean, received, key = args
        mean = mean[0].reshape(-1, block) if mean else None
        messages, kept = [], []
        for (j, blocks), got in zip(held, received, strict=True):
            message, new = sg_average(
                got, None if mean is None else mean[blocks], weight=weight, key=key_of(key, j),
                codec=codec, block_size=block,
            )  # fmt: skip
            messages.append(message)
            kept.append(new)
        if mean is None:
            return (tuple(messages),)
        return mean.at[span].set(jnp.concatenate(kept, axis=0)).reshape(-1), tuple(messages)

    def all_gather(messages):
        gather = jax.lax.all_gather
        return (tuple(gather(m, group.gather, axis=0, to="invarying") for m in messages),)

    def decode(gathered):
        parts = [sg_decode(g, codec=codec, block_size=block) for g in gathered]
        return (jnp.concatenate(parts, axis=1),)

    return (
        Stage("quantize", "compute", quantize, ("x", "key"), ("send",) if feedback else ()),
        Stage("all_to_all", "wire", all_to_all, ("quantize",)),
        Stage("average", "compute", average, ("all_to_all", "key"), ("mean",) if feedback else ()),
        Stage("all_gather", "wire", all_gather, ("average",)),
        Stage("decode", "compute", decode, ("all_gather",)),
    )


def scatter_gather_sum_flat(x, config: SyncConfig, *, n, local, weight, key, residual, scattered):
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
    group = group_of(config, n, local)
    x = _owned(x, config, group, scattered)
    if group.plain:
        # No slow hop to compress: the honest result is the plain float32 one.
        x = x * jnp.float32(weight)
        if config.hierarchical:
            x = _plain_shard(x, node_axis, local_axis, local)
        return x, residual
    block_size = config.block_size
    per_peer = x.shape[0] // (group.size * block_size)
    pieces = message_slices(per_peer, block_size * config.bits // 8, config.message_bytes)
    plan = scatter_gather_plan(
        config, group, weight=weight, held=tuple(enumerate(pieces)), feedback=residual is not None
    )
    values = {"x": x, "key": key}
    if residual is not None:
        values.update(send=residual[0], mean=residual[1])
    values = run(plan, values)
    x = values["decode"].reshape(-1)
    return x, None if residual is None else (values["send"], values["mean"])


# The integer wire ---------------------------------------------------------------------------


def integer_plan(group: Group, *, codec: Codec, block_size: int, start: int, stop: int,
                 feedback: bool):  # fmt: skip
    """The integer wire's stages for blocks ``[start, stop)`` of a bucket: encode -> psum ->
    decode.

    The plan reads ``x``, the group's vector of the bucket, whole or as a tuple of its
    consecutive parts (``buckets.to_bucket_parts``: each part is read where it lies), ``key``,
    and the bucket's ``agreed`` bounds and decode ``factors`` (the group's pmax of each
    device's, ``integer_sum``); with ``feedback`` it updates ``send`` (what this device's
    codes missed, as long as ``x``). Its ``decode`` is those blocks of the weighted sum, flat.
    ``codec`` is the config's ``codecs.Codec``: its bits, rounding and implementation.
    """
    width = integer.allreduce_width(codec.bits, group.size)
    lo, hi = start * block_size, stop * block_size

    def encode(*args):
        *send, x, agreed, key = args
        parts = x if isinstance(x, tuple) else (x,)
        seed = None if key is None else integer.dither_seed(key)
        codes, kept, offset = [], [], 0
        for part in parts:
            a, b = max(lo, offset), min(hi, offset + part.shape[0])
            if a < b:
                values = part[a - offset : b - offset]
                values = values + send[0][a:b] if send else values
                coded = codecs.integer_encode(
                    codec, values, agreed[a // block_size : b // block_size],
                    block_size=block_size, width=width, seed=seed, first_block=a // block_size,
                    feedback=bool(send),
                )  # fmt: skip
                codes.append(coded[0])
                kept.append(coded[1])
            offset += part.shape[0]
        codes = codes[0] if len(codes) == 1 else jnp.concatenate(codes)
        if not send:
            return (codes,)
        return send[0].at[lo:hi].set(kept[0] if len(kept) == 1 else jnp.concatenate(kept)), codes

    def psum(codes):
        return (jax.lax.psum(codes, group.axis),)

    def decode(total, factors):
        return (codecs.integer_decode(codec, total, factors[:, start:stop], width=width),)

    return (
        Stage("encode", "compute", encode, ("x", "agreed", "key"), ("send",) if feedback else ()),
        Stage("psum", "wire", psum, ("encode",)),
        Stage("decode", "compute", decode, ("psum", "factors")),
    )


def integer_sum(
    x: jax.Array,
    residual: jax.Array | None,
    *,
    group,
    group_size: int,
    weight: float,
    block_size: int,
    key: jax.Array | None,
    codec: Codec,
) -> tuple[jax.Array, jax.Array | None]:
    """``weight`` times the sum over ``group`` of the flat vectors ``x``, as integer codes.

    The bounds of each block are agreed by one pmax, the codes summed by one psum
    (``integer_plan``), and the decode factors agreed by one more pmax. One psum per call:
    an all-reduce cut into messages only runs slower through Gloo (benchmarks/RESULTS.md,
    "Integer wire and rings"), so the bucket is the message.

    Args:
      x: this device's flat float32 vector, or a tuple of consecutive parts of it
        (``buckets.to_bucket_parts``); each a whole number of blocks.
      residual: None, or this device's error-feedback residual, as long as ``x``.
      group: the axis name (or names) that sums.
      group_size: its size.
      weight: scales the decoded sum (1 / devices for a mean).
      block_size: values per grid.
      key: this device's PRNG key for stochastic rounding (None for nearest).
      codec: the ``codecs.Codec``: bits (8 or 4, see ``allreduce_width``), rounding and
        implementation.

    Returns:
      The decoded weighted sum, typed as replicated over ``group``, and the new residual
      (None without one).
    """
    parts = x if isinstance(x, tuple) else (x,)
    starts = np.cumsum([0, *(part.shape[0] for part in parts)]).tolist()
    if residual is not None:
        parts = [p + residual[s:e] for p, s, e in zip(parts, starts[:-1], starts[1:], strict=True)]
    bounds = jnp.concatenate([codecs.integer_bounds(codec, part, block_size) for part in parts])
    agreed = jax.lax.pmax(bounds, group)
    width = integer.allreduce_width(codec.bits, group_size)
    factors = codecs.decode_factors(
        codec, agreed, width=width, group_size=group_size, weight=weight
    )
    # The same on every device: the pmax changes no bit (module docstring).
    factors = jax.lax.pmax(factors, group)
    plan = integer_plan(
        Group(group, group, group_size, False, "allreduce"), codec=codec, block_size=block_size,
        start=0, stop=starts[-1] // block_size, feedback=residual is not None,
    )  # fmt: skip
    values = {"x": x, "agreed": agreed, "key": key, "factors": factors}
    if residual is not None:
        values["send"] = residual
    values = run(plan, values)
    return values["decode"], None if residual is None else values["send"]


def allreduce_sum_flat(x, config: SyncConfig, *, n, local, weight, key, residual, scattered):
    """The integer wire's all-reduce of one flat float32 bucket (``sum_shard``'s
    contract): its length a multiple of devices x block; returns ``sum_shard``'s shard and
    the new residuals, None without error feedback, else
    (send, mean) with ``mean`` empty (one compression, so one residual; ``residual_sizes``).
    This codec's ops are XLA fusions on every backend (``codecs/__init__.py``): an explicit
    ``implementation="pallas"`` raises ``NotImplementedError`` here.
    """
    node_axis, local_axis = config.axes
    group = group_of(config, n, local)
    x = _owned(x, config, group, scattered)
    if group.plain:
        # No slow hop to compress: the honest result is the plain float32 one.
        x = _joined(x) * jnp.float32(weight)
        if config.hierarchical:
            x = _plain_shard(x, node_axis, local_axis, local)
        return x, residual
    _warn_if_promoted(config.bits, group.size)
    send = None if residual is None else residual[0]
    x, send = integer_sum(
        x,
        send,
        group=group.axis,
        group_size=group.size,
        weight=weight,
        block_size=config.block_size,
        key=key,
        codec=config.codec,
    )
    return x, None if residual is None else (send, residual[1])


_WARNED_PROMOTION: set[int] = set()


def _warn_if_promoted(bits: int, group_size: int) -> None:
    """Warns, once per group size, when the integer wire's codes go as uint16 on a GPU:
    XLA:GPU promotes 16-bit integer all-reduces to 32 bits, float32's bytes."""
    width = integer.allreduce_width(bits, group_size)
    if width.bits != 16 or platform_of() != "gpu" or group_size in _WARNED_PROMOTION:
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


def _owned(x, config: SyncConfig, group: Group, scattered: bool):
    """What this device compresses, in float32, the codecs' dtype: its share of its node's
    sum, from a reduce-scatter within the node in the bucket's own dtype (bfloat16 buckets:
    half float32's bytes; ``buckets.Layout.bucket_dtype``) where the group needs one and
    ``x`` is not that share already; else ``x`` itself, whole or as its parts."""
    if group.scatter and not scattered:
        x = jax.lax.psum_scatter(_joined(x), config.local_axis, scatter_dimension=0, tiled=True)
    if isinstance(x, tuple):
        return tuple(part.astype(jnp.float32) for part in x)
    return x.astype(jnp.float32)


def sum_shard(x, config: SyncConfig, *, n, local, weight, key, residual, scattered=False):
    """The part of a flat float32 bucket's all-reduce that crosses between nodes, over
    ``config``'s wire; the bucket's length is a multiple of devices x block. ``x`` may come
    as a tuple of its parts: the integer wire reads them where they lie, the others join
    them. With ``scattered``, ``x`` is already this device's shard of its node's sum (a row
    of ``buckets.to_rows``): the reduce-scatter within the node is skipped.

    Returns this device's shard of the reduced bucket (all of it without a reduce-scatter
    within the node), typed as replicated over the devices that summed it, and the new
    residuals (None without error feedback; ``residual_sizes``). ``gather_shard`` makes it
    the whole bucket.
    """
    kwargs = dict(n=n, local=local, weight=weight, key=key, residual=residual, scattered=scattered)
    if group_of(config, n, local).wire != "allreduce":
        return scatter_gather_sum_flat(_joined(x), config, **kwargs)
    return allreduce_sum_flat(x, config, **kwargs)


def gather_shard(shard: jax.Array, config: SyncConfig, local: int, dtype=jnp.float32) -> jax.Array:
    """``sum_shard``'s shard as the whole reduced bucket, typed as replicated over both
    axes: an all_gather within the node after a reduce-scatter there, in ``dtype``, the
    bucket's (``buckets.Layout.bucket_dtype``; its leaves are cast to it after the gather,
    so a bfloat16 gather loses nothing), float32 otherwise."""
    if config.hierarchical and local > 1:
        return gather_invariant(shard.astype(dtype), config.local_axis)
    return shard


def sum_flat(x, config: SyncConfig, *, n, local, weight, key, residual):
    """The all-reduce of one flat float32 bucket: ``sum_shard`` then ``gather_shard``.
    Returns the reduced bucket, typed as replicated over both axes, and the new residuals."""
    shard, residual = sum_shard(
        x, config, n=n, local=local, weight=weight, key=key, residual=residual, scattered=False
    )
    dtype = (x[0] if isinstance(x, tuple) else x).dtype
    return gather_shard(shard, config, local, dtype), residual


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
