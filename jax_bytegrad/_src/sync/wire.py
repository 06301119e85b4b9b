"""The wires between nodes: how one flat float32 bucket's codes are summed over the mesh.

Every function here takes the bucket's ``config.BucketPlan``, resolved once where the sync
starts (``config.plan_sync``): its group, wire, width and codec are decided there, not here.

Each wire is written once, as its stages: those of one piece of a bucket between its
collectives (``integer_stages``, ``scatter_gather_stages``). The one-program step runs them
inline (``sum_shard``, through ``run``); the pipelined step runs each stage as a program of its
own (``algorithms/bytegrad/stages.py``); the GPU schedule tests count its collectives per bucket.

``wire="scatter_gather"`` is Bagua's ByteGrad (Gan et al., VLDB 2022), per flat bucket:

    psum_scatter over local (bucket dtype) -> this device owns 1/L of its node's sum
    quantize the owned shard as n chunks   -> all_to_all over node (uint8 + headers)
    decode n chunks, weighted sum, encode  -> one fused op, this device's chunk of the mean
    all_gather over node (uint8 + headers) -> decode: the whole owned shard
    all_gather over local (bucket dtype)   -> the whole bucket

The bucket's dtype within the node is float32, or bfloat16 for a bucket of bfloat16 leaves
(``buckets.Layout.bucket_dtypes``); the codecs read and write float32.

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
(``patterns.ring_all_to_all``). Same codes, same result, bit for bit.

The bytes each wire sends between nodes: benchmarks/RESULTS.md, "Bytes between nodes" and
"Decode factors: each block's grid once, not once per value".
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src import codecs
from jax_bytegrad._src.codecs import integer
from jax_bytegrad._src.sync.config import BucketPlan, Wire
from jax_bytegrad._src.sync.patterns import gather_invariant, message_slices, ring_all_to_all


def code_exchange(wire: Wire, message_bytes: int | None):
    """The all_to_all of the scatter-gather wire's codes, ``(x, axis) -> received``."""
    if wire == "ring":
        return lambda x, axis: ring_all_to_all(x, axis, message_bytes=message_bytes)
    return lambda x, axis: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


# A wire's stages ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage of a piece's way between nodes, as a function of named values.

    A wire's stages for one piece of a bucket are a tuple of these. The one-program sync
    runs them inline (``run``); the pipelined step runs each stage as a program of its own
    (``algorithms/bytegrad/stages.py``); both read the same functions, so the bits are the same.

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


def run(stages: tuple[Stage, ...], values: dict) -> dict:
    """Runs ``stages`` in the calling program: ``values`` with every stage's output (and
    updated residuals) added under its name."""
    values = dict(values)
    for stage in stages:
        outs = stage.fn(*(values[name] for name in (*stage.chains, *stage.reads)))
        values.update(zip((*stage.chains, stage.name), outs, strict=True))
    return values


# The scatter-gather wire ------------------------------------------------------------------------


def scatter_gather_stages(plan: BucketPlan, *, held, feedback: bool) -> tuple[Stage, ...]:
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
    codec, block, group, weight = plan.codec, plan.block_size, plan.group, plan.weight
    exchange = code_exchange(group.wire, plan.message_bytes)
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
            message, new = codecs.sg_encode(x[:, blocks], part, key=key_of(key, j), codec=codec)
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
            message, new = codecs.sg_average(
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
        parts = [codecs.sg_decode(g, codec=codec, block_size=block) for g in gathered]
        return (jnp.concatenate(parts, axis=1),)

    return (
        Stage("quantize", "compute", quantize, ("x", "key"), ("send",) if feedback else ()),
        Stage("all_to_all", "wire", all_to_all, ("quantize",)),
        Stage("average", "compute", average, ("all_to_all", "key"), ("mean",) if feedback else ()),
        Stage("all_gather", "wire", all_gather, ("average",)),
        Stage("decode", "compute", decode, ("all_gather",)),
    )


# The integer wire ---------------------------------------------------------------------------


def integer_stages(plan: BucketPlan, *, start: int, stop: int, feedback: bool):
    """The integer wire's stages for blocks ``[start, stop)`` of a bucket: encode -> psum ->
    decode.

    They read ``x``, the group's vector of the bucket, whole or as a tuple of its
    consecutive parts (``buckets.to_bucket_parts``: each part is read where it lies), ``key``,
    and the bucket's ``agreed`` bounds and decode ``factors`` (the group's pmax of each
    device's, ``sum_shard``); with ``feedback`` they update ``send`` (what this device's
    codes missed, as long as ``x``). Their ``decode`` is those blocks of the weighted sum,
    flat. The plan's ``codec`` gives the bits and rounding, its ``integer`` the codec's ops,
    its ``width`` the codes' width on the wire.
    """
    codec, block_size, width, axis = plan.codec, plan.block_size, plan.width, plan.group.axis
    ops = plan.integer
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
                coded = ops.encode(
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
        return (jax.lax.psum(codes, axis),)

    def decode(total, factors):
        return (ops.decode(codec, total, factors[:, start:stop], width=width),)

    return (
        Stage("encode", "compute", encode, ("x", "agreed", "key"), ("send",) if feedback else ()),
        Stage("psum", "wire", psum, ("encode",)),
        Stage("decode", "compute", decode, ("psum", "factors")),
    )


# The bucket's way: the reduce-scatter within the node, a wire, the gather --------------------


def _plain_shard(x, plan: BucketPlan) -> jax.Array:
    """A shard summed by nobody else (one node), typed as the wires' shards are: replicated
    over the node axis, and over the local one where no gather within the node follows.
    Size-1 gathers move no bytes; they only mark the value as replicated."""
    x = gather_invariant(x, plan.node_axis)
    return gather_invariant(x, plan.local_axis) if plan.local == 1 else x


def sum_shard(x, plan: BucketPlan, *, key, residual):
    """The part of a flat bucket's all-reduce that crosses between nodes: the plan's weight
    times the sum over its group, over its wire; the bucket's length is a multiple of devices
    x block. ``x`` may come as a tuple of its parts (``buckets.to_bucket_parts``, each a whole
    number of blocks): the integer wire reads them where they lie, the others join them.
    Without the plan's ``scatter``, ``x`` is already what this device sends (its row of its
    node's sums, ``buckets.own_rows``, or its whole bucket): no reduce-scatter within the node.

    The integer wire agrees on each block's bounds by one pmax, sums the codes by one psum
    (``integer_stages``) and agrees on the decode factors by one more pmax. One psum per
    bucket: an all-reduce cut into messages only runs slower through Gloo
    (benchmarks/RESULTS.md, "Integer wire and rings"), so the bucket is the message. Its ops
    are XLA fusions on every backend (``codecs/__init__.py``): an explicit
    ``implementation="pallas"`` raises ``NotImplementedError`` there.

    The scatter-gather wire sends the bucket as independent pieces of ``message_bytes`` of
    codes per peer (``scatter_gather_stages``). XLA runs the collectives one at a time, in
    program order, but a piece's quantize, average and decode only wait for their own data,
    so they can run while other pieces are on the wire, as far as free cores allow
    (docs/performance.md). Blocks are coded independently, so with nearest rounding the
    result does not depend on the split. ``wire="ring"`` sends the all_to_all as ppermute
    shifts (``ring_all_to_all``), with the same result.

    Args:
      x: this device's bucket (or its row), whole or as a tuple of its parts.
      plan: the bucket's plan.
      key: this device's PRNG key for the bucket's stochastic rounding (None for nearest).
      residual: None, or error feedback's (send, mean) residuals (``BucketPlan.residual``).

    Returns:
      This device's shard of the reduced bucket (all of it without a reduce-scatter within
      the node), typed as replicated over the devices that summed it, flat float32, and the
      new residuals: None without error feedback, else (send, mean) (the integer wire
      compresses once and keeps ``mean`` as it is, empty). ``gather_shard`` makes the shard
      the whole bucket.
    """
    codec, block_size, group = plan.codec, plan.block_size, plan.group
    integer_wire = group.wire == "allreduce"
    # What this device compresses, in float32, the codecs' dtype: its share of its node's sum,
    # from a reduce-scatter within the node in the bucket's own dtype (bfloat16 buckets: half
    # float32's bytes) where the plan says so; else ``x`` itself, whole, or as its parts where
    # the integer wire compresses them.
    if isinstance(x, tuple) and (plan.scatter or group.plain or not integer_wire):
        x = jnp.concatenate(x)
    if plan.scatter:
        x = jax.lax.psum_scatter(x, plan.local_axis, scatter_dimension=0, tiled=True)
    x = tuple(p.astype(jnp.float32) for p in x) if isinstance(x, tuple) else x.astype(jnp.float32)
    if group.plain:
        # No slow hop to compress: the honest result is the plain float32 one.
        x = x * jnp.float32(plan.weight)
        return (_plain_shard(x, plan) if plan.hierarchical else x), residual
    feedback = residual is not None
    values = {"x": x, "key": key}
    if feedback:
        values.update(send=residual[0], mean=residual[1])
    if integer_wire:
        ops, parts = plan.integer, x if isinstance(x, tuple) else (x,)
        starts = np.cumsum([0, *(part.shape[0] for part in parts)]).tolist()
        if feedback:
            ends = zip(parts, starts[:-1], starts[1:], strict=True)
            parts = [part + residual[0][s:e] for part, s, e in ends]
        bounds = jnp.concatenate([ops.bounds(codec, part, block_size) for part in parts])
        agreed = values["agreed"] = jax.lax.pmax(bounds, group.axis)
        factors = ops.factors(
            codec, agreed, width=plan.width, group_size=group.size, weight=plan.weight
        )
        # The same on every device: the pmax changes no bit (module docstring).
        values["factors"] = jax.lax.pmax(factors, group.axis)
        stages = integer_stages(plan, start=0, stop=starts[-1] // block_size, feedback=feedback)
    else:
        per_peer = x.shape[0] // (group.size * block_size)
        pieces = message_slices(per_peer, codec.code_bytes(block_size), plan.message_bytes)
        stages = scatter_gather_stages(plan, held=tuple(enumerate(pieces)), feedback=feedback)
    values = run(stages, values)
    total = values["decode"].reshape(-1)
    return total, None if residual is None else (values["send"], values["mean"])


def gather_shard(shard: jax.Array, plan: BucketPlan, dtype=None) -> jax.Array:
    """``sum_shard``'s shard as the whole reduced bucket, typed as replicated over both
    axes: an all_gather within the node where the plan says so (``BucketPlan.gather``), in
    ``dtype`` (None: the plan's, the bucket's dtype, ``buckets.Layout.bucket_dtypes``; its
    leaves are cast to it after the gather, so a bfloat16 gather loses nothing); the shard
    itself otherwise."""
    if plan.gather:
        dtype = plan.dtype if dtype is None else dtype
        return gather_invariant(shard.astype(dtype), plan.local_axis)
    return shard


def sum_flat(x, plan: BucketPlan, *, key, residual):
    """The all-reduce of one flat bucket: ``sum_shard`` then ``gather_shard`` in ``x``'s
    dtype. Returns the reduced bucket, typed as replicated over both axes, and the new
    residuals."""
    shard, residual = sum_shard(x, plan, key=key, residual=residual)
    dtype = (x[0] if isinstance(x, tuple) else x).dtype
    return gather_shard(shard, plan, dtype), residual
