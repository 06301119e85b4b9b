"""The wires between nodes: how one flat float32 bucket's codes are summed over the mesh.

``wire="scatter_gather"`` is Bagua's ByteGrad (Gan et al., VLDB 2022), per flat bucket:

    psum_scatter over local (float32)      -> this device owns 1/L of its node's sum
    quantize the owned shard as n chunks   -> all_to_all over node (uint8 + headers)
    decode n chunks, weighted sum, encode  -> one fused op, this device's chunk of the mean
    all_gather over node (uint8 + headers) -> decode: the whole owned shard
    all_gather over local (float32)        -> the whole bucket

No device gathers all n quantized gradients (O(n) memory and traffic), and, unlike Bagua,
which funnels a node's traffic through one leader GPU, all L devices of a node share the
inter-node hop. Bytes between nodes per device: 2 (n-1)/n N/L of codes plus headers at 8
bits, half that at 4, against 8 (n-1)/n N/L for a float32 ring all-reduce. With error
feedback each device keeps what its two compressions left unsent: (1 + 1/n) N/L float32
values per device, hierarchical; (1 + 1/(nL)) N flat.

Through Gloo on CPU hosts, pairwise exchanges reach only part of a link while an all-reduce
runs at line rate (benchmarks/RESULTS.md, "Integer wire and rings"), hence the two others:

``wire="allreduce"`` (the THC and IntSGD family: Li et al., "THC: Accelerating Distributed
Deep Learning Using Tensor Homomorphic Compression", NSDI 2024; Mishchenko et al., "IntSGD:
Adaptive Floatless Compression of Stochastic Gradients", ICLR 2022). Codes that all devices
put on one shared grid add up as integers, so the sum between nodes is a plain integer
``psum``. Per flat bucket, in the group of g devices that sums (the nodes, or every device
with ``hierarchical=False``):

    psum_scatter over local (float32)      -> this device owns 1/L of its node's sum
    block bounds [max, -min], one pmax     -> every device has the same grid per block
    quantize onto the grid (L levels)      -> uint8 (or uint16) codes, g * L <= 2**bits - 1
    psum over the group (integers)         -> cannot overflow: headroom
    decode factors per block, one pmax     -> the same on every device (see below)
    decode the sum                         -> the same integers, the same float ops
    all_gather over local (float32)        -> the whole bucket

The grid of a block, from the group's lo = min and hi = max (every device computes it from
the same pmax, so every device holds the same grid), with L levels per device:

    scale = max((hi - lo) / D, max(|lo|, |hi|) * 2**-23)   D = L nearest, L - 1 stochastic
    zero  = round(-lo / scale) (nearest), ceil(-lo / scale) (stochastic), an integer
    code  = clip(round(x / scale) + zero, 0, L)     (stochastic: floor + (u < fraction))
    sum   = psum(code)                               <= g * L, no wrap-around
    mean  = (sum - g * zero) * (scale * weight)      (sum - g * zero in int32, exact)

As in the min-max codec (``codecs/reference.py``), an integer zero point keeps 0 on the
grid: a value that is 0 on every device decodes to exactly 0, and a block that is the same
constant c everywhere has scale = c, zero = -1 and codes 0, and decodes to g * c * weight.
Nearest rounding errs by at most scale / 2 per device; stochastic rounding is unbiased
(D = L - 1 and ``ceil`` make the grid cover [lo, hi], so nothing is clipped). Each device
draws its own uniforms: a 32-bit integer hash of (element index, a seed from the device's
key), 24 bits of resolution; far cheaper on CPU than threefry, and, being a function of the
element's index, the same for any message split.

Widths, from the group size g (``allreduce_width``): 8-bit codes go as uint8 with
L = 255 // g levels while g <= 8 (31 levels or more), as uint16 with L = 65535 // g beyond
(twice the bytes); 4-bit codes go two per byte (adjacent values) with L = 15 // g while
g <= 2 (the sum of g nibbles stays below 16, so the byte-wise sum does not carry), and are
refused beyond.
The rule, from the measured error of the mean (benchmarks/RESULTS.md, "Widths"): uint8
while its error stays below half that of the 4-bit scatter-gather wire, which trains within
a point of float32. It is 1.3-1.5x the 8-bit scatter-gather wire's at 2 nodes, 3.8-6.8x at
8 (0.071 against 0.167), and would be 0.151 at 16.

XLA:CPU contracts a product that feeds an add into one fused multiply-add when both land in
one fusion, and copies small per-block computations into every fusion that reads them; so
no product here feeds an add (exact halves, or a clip in between), or the bits would depend
on the fusions and so on the message split.

That copying also costs time: the decode is fused into each optimizer pass that reads the
mean, which walks the leaf's shape, not the blocks, so the grid's ~40 operations ran once
per value in every such pass (1.6-2x the pass's time on one core; benchmarks/RESULTS.md,
"Decode factors"). The decode's two factors per block, ``scale * weight`` and ``g * zero``, are
therefore computed once and go through a ``pmax`` over the group: they are the same on every
device, so the pmax changes no bit, and XLA reads a collective's result as data instead of
recomputing it. 8 bytes per block, as the bounds.

Error feedback keeps one residual per device: what its codes failed to carry,
``x + residual - (code - zero) * scale``. Summed over the group, the residuals and the
decoded sum give back the sum of ``x + residual`` exactly where float32 allows.

Non-finite values stay visible: a block holding NaN or +-inf on any device has its bound
set to +inf there, the pmax spreads it, and every device decodes that block to NaN
(the scatter-gather wire spoils only the chunk of the device that held it; here the whole
block, on every device, for every device's contribution, as a float32 psum would).

Bytes between nodes per device (8-bit, g <= 8): 2 (g-1)/g N/L of codes plus 2 (g-1)/g
16 N / (L block) of bounds and decode factors: 0.254x a float32 ring all-reduce at
1024-value blocks.

``wire="ring"``: the scatter-gather wire with its all_to_all done as g - 1 ppermute shifts
(``ring_all_to_all``). Same codes, same result, bit for bit.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src.config import SyncConfig, Wire
from jax_bytegrad._src.quantization import (
    HEADER_WIDTH,
    average_blocks,
    average_requantize,
    dequantize_blocks,
    quantize_blocks,
    quantize_with_feedback,
)

# Largest group whose sum fits each width with enough levels per device (module docstring).
MAX_GROUP = {4: 2, 8: 8}
_F32_MAX = float(jnp.finfo(jnp.float32).max)
# Keeps |zero| <= 2**23, as in the min-max codec.
_SCALE_FLOOR = 2.0**-23


# Collective helpers ---------------------------------------------------------------------------


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


# Ring patterns ------------------------------------------------------------------------------


def _shift(n: int, s: int) -> list[tuple[int, int]]:
    return [(i, (i + s) % n) for i in range(n)]


def ring_all_to_all(x: jax.Array, axis, *, message_bytes: int | None = None) -> jax.Array:
    """``jax.lax.all_to_all(x, axis, 0, 0, tiled=True)`` as n - 1 ppermute shifts.

    Shift s sends row me + s of ``x`` to device me + s and receives device me - s's row for
    this device. Each device then sends to one peer and receives from another, except at
    s = n / 2 (n even, and every shift at n = 2), where pairs swap: through Gloo a swap gets
    about half a link (benchmarks/RESULTS.md, "Integer wire and rings").

    Args:
      x: shape (n, ...), n the size of ``axis``: row j goes to device j.
      axis: a mesh axis name, or a tuple of them.
      message_bytes: bytes per message of each shift; None sends each row in one.

    Returns:
      Shape (n, ...): row j is what device j sent to this one, as ``all_to_all`` returns it.
    """
    n = x.shape[0]
    me = jax.lax.axis_index(axis)
    out = x  # row me is this device's own
    for s in range(1, n):
        row = jax.lax.dynamic_index_in_dim(x, (me + s) % n, 0, keepdims=False)
        got = split_ppermute(row, axis, _shift(n, s), message_bytes)
        out = jax.lax.dynamic_update_index_in_dim(out, got, (me - s) % n, 0)
    return out


def ring_all_gather(x: jax.Array, axis, n: int, *, message_bytes: int | None = None) -> jax.Array:
    """``jax.lax.all_gather(x, axis, axis=0)`` as n - 1 shifts by one, each device passing on
    what it got last. The result is typed varying over ``axis`` (public JAX has no way to
    mark a ppermute's result replicated), so the wires here do not use it; it is measured in
    benchmarks/network.py.
    """
    me = jax.lax.axis_index(axis)
    out = jnp.broadcast_to(x[None], (n, *x.shape))
    current = x
    for s in range(1, n):
        current = split_ppermute(current, axis, _shift(n, 1), message_bytes)
        out = jax.lax.dynamic_update_index_in_dim(out, current, (me - s) % n, 0)
    return out


def _all_to_all(wire: Wire, message_bytes: int | None):
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


def _piece_keys(key):
    """The two rounding keys of one message piece (its quantize and its requantize)."""
    return (None, None) if key is None else jax.random.split(key)


def sg_encode(x, send, *, key, codec):
    """The scatter-gather wire's first stage: quantize one piece for its owners.

    ``x`` (and error feedback's ``send`` residual, or None) has shape (peers, blocks,
    block_size): row j goes to peer j. Returns the message, each block's codes with its
    header in one uint8 row, shape (peers, blocks, bytes), and the new ``send`` residual.
    ``codec`` holds the ``stochastic``, ``bits`` and ``implementation`` arguments of the
    codec's functions; ``key`` is the piece's key (None for nearest rounding).
    """
    peers, blocks, block_size = x.shape
    x = x.reshape(peers * blocks, block_size)
    key = _piece_keys(key)[0]
    if send is None:
        codes, header = quantize_blocks(x, key=key, **codec)
    else:
        codes, header, send = quantize_with_feedback(x, send.reshape(x.shape), key=key, **codec)
        send = send.reshape(peers, blocks, block_size)
    return _pack(codes, header).reshape(peers, blocks, -1), send


def sg_average(received, mean, *, weight, key, codec, block_size):
    """The second stage: average the received pieces and requantize this device's chunk.

    ``received`` is the all_to_all of ``sg_encode``'s messages, (peers, blocks, bytes);
    ``mean`` error feedback's residual of the requantize, (blocks, block_size), or None.
    Returns the message to gather, (blocks, bytes), and the new ``mean`` residual.
    """
    bits, impl = codec["bits"], codec["implementation"]
    codes, header = _unpack(received, block_size * bits // 8)
    key = _piece_keys(key)[1]
    if mean is None:
        codes, header = average_requantize(codes, header, weight=weight, key=key, **codec)
    else:
        total = average_blocks(codes, header, weight=weight, bits=bits, implementation=impl)
        codes, header, mean = quantize_with_feedback(total, mean, key=key, **codec)
    return _pack(codes, header), mean


def sg_decode(gathered, *, codec, block_size):
    """The last stage: decode the gathered averages, (peers, blocks, bytes), to float32
    values of shape (peers, blocks, block_size)."""
    peers, blocks = gathered.shape[:2]
    codes, header = _unpack(gathered, block_size * codec["bits"] // 8)
    decoded = dequantize_blocks(
        codes.reshape(peers * blocks, -1),
        header.reshape(peers * blocks, -1),
        bits=codec["bits"],
        implementation=codec["implementation"],
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


def scatter_gather_sum_flat(x, config: SyncConfig, *, n, local, weight, key, codec, residual):
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
    exchange = _all_to_all(config.wire, config.message_bytes)
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
                codec=codec,
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


@dataclasses.dataclass(frozen=True)
class Width:
    """How the integer wire sends codes for a group of devices.

    Attributes:
      bits: bits per code on the wire: 4 (two per byte), 8 or 16.
      levels: L, the largest code one device sends; group size x L < 2**bits.
    """

    bits: int
    levels: int

    @property
    def dtype(self):
        return jnp.uint16 if self.bits == 16 else jnp.uint8


def allreduce_width(bits: int, group_size: int) -> Width:
    """The wire width and levels per device of the integer wire for ``group_size`` devices.

    Args:
      bits: the code width asked for, 8 or 4.
      group_size: how many devices sum their codes (the node count, or every device with
        ``hierarchical=False``).

    Returns:
      A ``Width``: uint8 for 8 bits up to 8 devices, uint16 beyond; packed nibbles for 4
      bits up to 2 devices.

    Raises:
      ValueError: for 4 bits over more than 2 devices, or a group too large for uint16.

    Examples:
      >>> allreduce_width(8, 2), allreduce_width(8, 16), allreduce_width(4, 2)
      (Width(bits=8, levels=127), Width(bits=16, levels=4095), Width(bits=4, levels=7))
    """
    if bits == 4 and group_size > MAX_GROUP[4]:
        raise ValueError(
            f"wire='allreduce': 4-bit codes sum over at most {MAX_GROUP[4]} devices (their "
            f"nibbles must not carry), got {group_size}; pass bits=8, or wire='scatter_gather' "
            "for 4 bits"
        )
    width = bits if bits == 4 or group_size <= MAX_GROUP[8] else 16
    levels = (2**width - 1) // group_size
    if levels < 2:
        raise ValueError(
            f"wire='allreduce': {group_size} devices leave fewer than 2 levels each in uint16; "
            "pass wire='scatter_gather'"
        )
    return Width(width, levels)


def _fmix32(h: jax.Array) -> jax.Array:
    """A 32-bit integer finalizer (MurmurHash3's): every input bit flips each output bit
    with probability about one half."""
    h = h ^ (h >> 16)
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def dither(seed: jax.Array, index: jax.Array) -> jax.Array:
    """Uniforms in [0, 1) on a 2**-24 grid, one per element ``index``, from a (2,) uint32
    seed: two rounds of an integer hash. Cheaper on CPU than ``jax.random.uniform``
    (RESULTS.md); as a function of the index, independent of how the bucket is split.
    """
    h = _fmix32(index ^ seed[0])
    h = _fmix32(h + seed[1])
    return (h >> 8).astype(jnp.float32) * np.float32(2.0**-24)


def _bounds(x: jax.Array) -> jax.Array:
    """Each row's [max, -min], both +inf for a row holding NaN or +-inf, shape (rows, 2).

    Max of (x, -x) in one variadic reduce; NaN propagates through it and is then made +inf,
    which a pmax spreads to every device (a NaN may not survive a max through Gloo).
    """
    hi, neg_lo = jax.lax.reduce(
        (x, -x),
        (np.float32(-np.inf), np.float32(-np.inf)),
        lambda a, b: (jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1])),
        (1,),
    )
    bounds = jnp.stack([hi, neg_lo], axis=1)
    finite = jnp.isfinite(hi) & jnp.isfinite(neg_lo)
    return jnp.where(finite[:, None], bounds, np.float32(np.inf))


def _grid(bounds: jax.Array, levels: int, stochastic: bool):
    """Scale, integer zero point and 1 / scale per block, shape (blocks, 1), from the bounds."""
    hi, lo = bounds[:, 0:1], -bounds[:, 1:2]
    steps = levels - 1 if stochastic else levels
    magnitude = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    # No product may feed an add (module docstring): the halves are exact products, so a
    # contracted hi * 0.5 - lo * 0.5 rounds the same; they keep +-3e38 in one block from
    # overflowing.
    span = hi - lo
    span = jnp.where(
        jnp.isfinite(span),
        span * np.float32(1 / steps),
        (hi * np.float32(0.5) - lo * np.float32(0.5)) * np.float32(2 / steps),
    )
    scale = jnp.maximum(span, magnitude * np.float32(_SCALE_FLOOR))
    inv_scale = jnp.where(scale > 0, 1.0 / scale, 0.0)
    shift = -lo * inv_scale
    zero = jnp.ceil(shift) if stochastic else jnp.round(shift)
    constant = hi == lo
    finite = jnp.isfinite(lo) & jnp.isfinite(hi)
    scale = jnp.where(finite, jnp.where(constant, lo, scale), np.float32(np.nan))
    zero = jnp.where(finite, jnp.where(constant, -1.0, zero), 0.0)
    inv_scale = jnp.where(finite & ~constant, inv_scale, 0.0)
    return scale, zero, inv_scale


def _encode(x, scale, zero, inv_scale, levels: int, uniforms):
    """Codes of ``x`` (blocks, block_size) on the grid, as float32 integers in [0, levels]."""
    # |y| <= 2**23 + levels on the grid: the clip changes no value, and keeps the product
    # from being contracted with ``y - floor`` (module docstring).
    y = jnp.clip(x * inv_scale, np.float32(-(2.0**24)), np.float32(2.0**24))
    if uniforms is None:
        y = jnp.round(y)
    else:
        floor = jnp.floor(y)
        # Against the exact fraction, not floor(y + u): unbiased even where |y| nears 2**23.
        y = floor + (uniforms < y - floor).astype(jnp.float32)
    # Non-finite blocks have inv_scale = 0, so inf * 0 = NaN here; they decode via the scale.
    y = jnp.where(jnp.isnan(y), 0.0, y)
    return jnp.clip(y + zero, 0.0, np.float32(levels))


def _to_wire(codes: jax.Array, width: Width) -> jax.Array:
    """(blocks, block_size) float32 codes as the wire sends them: 4-bit codes two per byte,
    each even-indexed value in the low nibble and the value after it in the high one.

    Not the codec's layout (``codecs.reference.pack``: a block's halves): XLA:CPU fuses the
    encode into adjacent pairs 1.9x as fast as into halves (benchmarks/RESULTS.md, "Two
    layouts of the integer wire").
    """
    if width.bits == 4:
        pairs = codes.astype(jnp.uint8).reshape(codes.shape[0], -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4)
    return codes.astype(width.dtype)


def _from_wire(total: jax.Array, width: Width) -> jax.Array:
    """Inverse of ``_to_wire`` on the summed codes: (blocks, block_size) int32."""
    total = total.astype(jnp.int32)
    if width.bits == 4:
        nibbles = (total[..., None] >> np.array([[[0, 4]]], np.int32)) & 15
        return nibbles.reshape(total.shape[0], -1)
    return total


def integer_bounds(x: jax.Array, block_size: int) -> jax.Array:
    """The integer wire's first stage: each block's [max, -min] of the flat vector ``x``
    (after adding the residual), shape (blocks, 2); the group then agrees on them with one
    ``pmax``."""
    return _bounds(x.reshape(-1, block_size))


def integer_encode(x, bounds, *, block_size, width, stochastic, seed, first_block=0,
                   feedback):  # fmt: skip
    """The integer wire's second stage: codes of the flat vector ``x`` on the group's grid.

    Args:
      x: this device's values (residual added), a whole number of blocks.
      bounds: the group's ``pmax`` of ``integer_bounds`` for these blocks.
      block_size: values per block.
      width: ``allreduce_width`` of the group.
      stochastic: the grid of stochastic rounding (``seed`` draws the dither).
      seed: None (nearest rounding), or this device's (2,) uint32 seed.
      first_block: the index of ``x``'s first block in its bucket: the dither is a function
        of the element's index in the bucket, so any split of a bucket sends the same codes.
      feedback: also return what the codes missed (error feedback's new residual).

    Returns:
      The codes as the wire sends them (``width``'s dtype, or packed nibbles), flat per
      block row, and the flat residual (None without ``feedback``).
    """
    blocks = x.reshape(-1, block_size)
    scale, zero, inv_scale = _grid(bounds, width.levels, stochastic)
    uniforms = None
    if seed is not None:
        rows = jax.lax.broadcasted_iota(jnp.uint32, blocks.shape, 0)
        if first_block:
            rows = rows + np.uint32(first_block)
        index = rows * np.uint32(block_size) + jax.lax.broadcasted_iota(jnp.uint32, blocks.shape, 1)
        uniforms = dither(seed, index)
    codes = _encode(blocks, scale, zero, inv_scale, width.levels, uniforms)
    kept = None
    if feedback:
        # The clip stands between the product and the subtraction: no fused multiply-add
        # (module docstring), the same residual for any split.
        kept = (blocks - jnp.clip((codes - zero) * scale, -_F32_MAX, _F32_MAX)).reshape(-1)
    return _to_wire(codes, width), kept


def decode_factors(bounds, *, width, group_size, weight, stochastic) -> jax.Array:
    """The decode's factors per block from the group's bounds, shape (2, blocks) int32:
    the float32 bits of ``scale * weight``, and ``g * zero``.

    One int32 array, so that the group agrees on both with one exact ``pmax`` (module
    docstring: the factors then reach every fused decode as data). Each factor is a
    contiguous row: read from (blocks, 2) pairs, an Adam pass with the decode fused in took
    1.4x as long on one core (benchmarks/RESULTS.md, "Two layouts of the integer wire").
    """
    scale, zero, _ = _grid(bounds, width.levels, stochastic)
    # |zero| <= 2**23 + 1 and g <= 2**16 / levels: g * zero fits int32.
    offset = (np.int32(group_size) * zero.astype(jnp.int32)).astype(jnp.int32)
    factor = jax.lax.bitcast_convert_type(scale * np.float32(weight), jnp.int32)
    return jnp.stack([factor[:, 0], offset[:, 0]])


def integer_decode(total, factors, *, width) -> jax.Array:
    """The integer wire's last stage: ``weight`` times the decoded sum of the group's codes.

    ``total`` is the ``psum`` of ``integer_encode``'s codes, ``factors`` the group's
    ``decode_factors`` of the same blocks. Returns the flat float32 values.
    """
    factor = jax.lax.bitcast_convert_type(factors[0], jnp.float32)[:, None]
    offset = factors[1][:, None]
    total = _from_wire(total, width)
    # sum - g * zero is exact in int32 (g * levels < 2**16); the one rounding to float32 and
    # the one product are the same on every device.
    decoded = (total - offset).astype(jnp.float32) * factor
    return jnp.clip(decoded, -_F32_MAX, _F32_MAX).reshape(-1)


def dither_seed(key: jax.Array) -> jax.Array:
    """The (2,) uint32 seed of ``dither`` from a device's PRNG key for one bucket."""
    return jax.random.bits(key, (2,), jnp.uint32)


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
    width = allreduce_width(bits, group_size)
    parts = x if isinstance(x, tuple) else (x,)
    starts = np.cumsum([0, *(part.shape[0] for part in parts)]).tolist()
    if residual is not None:
        parts = [p + residual[s:e] for p, s, e in zip(parts, starts[:-1], starts[1:], strict=True)]
    bounds = jnp.concatenate([integer_bounds(part, block_size) for part in parts])
    bounds = jax.lax.pmax(bounds, group)
    seed = None if key is None else dither_seed(key)
    encoded = []
    for part, start, stop in zip(parts, starts[:-1], starts[1:], strict=True):
        first, last = start // block_size, stop // block_size
        encoded.append(
            integer_encode(
                part, bounds[first:last], block_size=block_size, width=width,
                stochastic=stochastic, seed=seed, first_block=first, feedback=residual is not None,
            )
        )  # fmt: skip
    codes = jnp.concatenate([c for c, _ in encoded])
    kept = None if residual is None else jnp.concatenate([k for _, k in encoded])
    total = jax.lax.psum(codes, group)
    factors = decode_factors(
        bounds, width=width, group_size=group_size, weight=weight, stochastic=stochastic
    )
    # The same on every device: the pmax changes no bit (module docstring).
    factors = jax.lax.pmax(factors, group)
    return integer_decode(total, factors, width=width), kept


def allreduce_sum_flat(x, config: SyncConfig, *, n, local, weight, key, codec, residual):
    """The integer wire's all-reduce of one flat float32 bucket (``sum_shard``'s
    contract): its length a multiple of devices x block; returns ``sum_shard``'s shard and
    the new residuals, None without error feedback, else
    (send, mean) with ``mean`` empty (one compression, so one residual; ``residual_sizes``).
    ``codec["implementation"]`` is not used: this codec is jnp, which XLA fuses on every
    backend.
    """
    node_axis, local_axis = config.axes
    hierarchical = config.hierarchical
    if hierarchical:
        if local > 1:
            x = jax.lax.psum_scatter(_joined(x), local_axis, scatter_dimension=0, tiled=True)
        # With one device per node, summing over both axes reaches the same devices and
        # types the result replicated over both.
        group, group_size = (node_axis if local > 1 else (node_axis, local_axis)), n
    else:
        group, group_size = (node_axis, local_axis), n * local
    if group_size == 1:
        # No slow hop to compress: the honest result is the plain float32 one.
        x = _joined(x) * jnp.float32(weight)
        if hierarchical:
            x = _plain_shard(x, node_axis, local_axis, local)
        return x, residual
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


def _plain_shard(x, node_axis, local_axis, local: int) -> jax.Array:
    """A shard summed by nobody else (one node), typed as the wires' shards are: replicated
    over the node axis, and over the local one where no gather within the node follows.
    Size-1 gathers move no bytes; they only mark the value as replicated."""
    x = gather_invariant(x, node_axis)
    return gather_invariant(x, local_axis) if local == 1 else x


def _joined(x) -> jax.Array:
    """A bucket given whole or as its parts (``buckets.to_bucket_parts``), as one vector."""
    return jnp.concatenate(x) if isinstance(x, tuple) else x


def sum_shard(x, config: SyncConfig, *, n, local, weight, key, codec, residual):
    """The part of a flat float32 bucket's all-reduce that crosses between nodes, over
    ``config``'s wire; the bucket's length is a multiple of devices x block. ``x`` may come
    as a tuple of its parts: the integer wire reads them where they lie, the others join
    them.

    Returns this device's shard of the reduced bucket (all of it without a reduce-scatter
    within the node), typed as replicated over the devices that summed it, and the new
    residuals (None without error feedback; ``residual_sizes``). ``gather_shard`` makes it
    the whole bucket.
    """
    group_size = n if config.hierarchical else n * local
    allreduce = config.wire_for(group_size) == "allreduce"
    if not allreduce:
        return scatter_gather_sum_flat(
            _joined(x), config, n=n, local=local, weight=weight, key=key, codec=codec,
            residual=residual,
        )  # fmt: skip
    return allreduce_sum_flat(
        x, config, n=n, local=local, weight=weight, key=key, codec=codec, residual=residual
    )


def gather_shard(shard: jax.Array, config: SyncConfig, local: int) -> jax.Array:
    """``sum_shard``'s shard as the whole reduced bucket, typed as replicated over both
    axes: a float32 all_gather within the node after a reduce-scatter there."""
    if config.hierarchical and local > 1:
        return gather_invariant(shard, config.local_axis)
    return shard


def sum_flat(x, config: SyncConfig, *, n, local, weight, key, codec, residual):
    """The all-reduce of one flat float32 bucket: ``sum_shard`` then ``gather_shard``.
    Returns the reduced bucket, typed as replicated over both axes, and the new residuals."""
    shard, residual = sum_shard(
        x, config, n=n, local=local, weight=weight, key=key, codec=codec, residual=residual
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
    group_size = nodes if config.hierarchical else nodes * per_node
    one_residual = config.wire_for(group_size) == "allreduce"
    sizes = []
    for padded in padded_sizes:
        send = padded // per_node if config.hierarchical else padded
        if group_size == 1:
            sizes.append((0, 0))
        else:
            sizes.append((send, 0 if one_residual else send // group_size))
    return tuple(sizes)
