"""Wires between nodes for ``compressed_mean``: an integer all-reduce, and ring patterns.

The scatter-gather wire of ``collectives`` (Bagua's ByteGrad) sends each node's codes to
their owner with an all_to_all and the averaged codes back with an all_gather. Through Gloo
on CPU hosts, pairwise exchanges reach only part of a link while an all-reduce runs at line
rate (benchmarks/RESULTS.md, "Integer wire and rings"). This module adds:

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
(twice the bytes); 4-bit codes go packed two per byte with L = 15 // g while g <= 2 (the sum
of g nibbles stays below 16, so the byte-wise sum does not carry), and are refused beyond.
The rule, from the measured error of the mean (benchmarks/RESULTS.md, "Widths"): uint8
while its error stays below half that of the 4-bit scatter-gather wire, which trains within
a point of float32. It is 1.3-1.5x the 8-bit scatter-gather wire's at 2 nodes, 3.8-6.8x at
8 (0.071 against 0.167), and would be 0.151 at 16.

XLA:CPU contracts a product that feeds an add into one fused multiply-add when both land in
one fusion, and copies small per-block computations into every fusion that reads them; so
no product here feeds an add (exact halves, or a clip in between), or the bits would depend
on the fusions and so on the message split.

Error feedback keeps one residual per device: what its codes failed to carry,
``x + residual - (code - zero) * scale``. Summed over the group, the residuals and the
decoded sum give back the sum of ``x + residual`` exactly where float32 allows.

Non-finite values stay visible: a block holding NaN or +-inf on any device has its bound
set to +inf there, the pmax spreads it, and every device decodes that block to NaN
(the scatter-gather wire spoils only the chunk of the device that held it; here the whole
block, on every device, for every device's contribution, as a float32 psum would).

Bytes between nodes per device (8-bit, g <= 8): 2 (g-1)/g N/L of codes plus 2 (g-1)/g
8 N / (L block) of bounds: 0.252x a float32 ring all-reduce at 1024-value blocks.

``wire="ring"``: the scatter-gather wire with its all_to_all done as g - 1 ppermute shifts
(``ring_all_to_all``). Same codes, same result, bit for bit.
"""

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src.codecs.reference import pack, unpack
from jax_bytegrad._src.collectives import gather_invariant, message_slices, split_ppermute

Wire = Literal["scatter_gather", "allreduce", "ring"]
WIRES = ("scatter_gather", "allreduce", "ring")

# Largest group whose sum fits each width with enough levels per device (module docstring).
MAX_GROUP = {4: 2, 8: 8}
_F32_MAX = float(jnp.finfo(jnp.float32).max)
# Keeps |zero| <= 2**23, as in the min-max codec.
_SCALE_FLOOR = 2.0**-23


def check_wire(wire, where: str) -> None:
    if wire not in WIRES:
        raise ValueError(
            f"{where}: wire must be one of {WIRES}, got {wire!r}; 'scatter_gather' is the default"
        )


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


def all_to_all(wire: Wire, message_bytes: int | None):
    """The all_to_all of the scatter-gather wire's codes, ``(x, axis) -> received``."""
    if wire == "ring":
        return lambda x, axis: ring_all_to_all(x, axis, message_bytes=message_bytes)
    return lambda x, axis: jax.lax.all_to_all(x, axis, 0, 0, tiled=True)


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
    if width.bits == 4:
        return pack(codes.astype(jnp.uint8), 4)
    return codes.astype(width.dtype)


def _from_wire(total: jax.Array, width: Width) -> jax.Array:
    if width.bits == 4:
        total = unpack(total, 4)
    return total.astype(jnp.int32)


def _integer_piece(x, *, scale, zero, inv_scale, group, group_size, width, weight, uniforms,
                   feedback):  # fmt: skip
    """Quantize, sum and decode one message's worth of blocks; also what the codes missed."""
    codes = _encode(x, scale, zero, inv_scale, width.levels, uniforms)
    kept = None
    if feedback:
        # The clip stands between the product and the subtraction: no fused multiply-add
        # (module docstring), the same residual for any split.
        kept = x - jnp.clip((codes - zero) * scale, -_F32_MAX, _F32_MAX)
    total = _from_wire(jax.lax.psum(_to_wire(codes, width), group), width)
    # sum - g * zero is exact in int32 (|zero| <= 2**23 + 1, g * levels < 2**16); the one
    # rounding to float32 and the one product are the same on every device.
    offset = (np.int32(group_size) * zero.astype(jnp.int32)).astype(jnp.int32)
    decoded = (total - offset).astype(jnp.float32) * (scale * np.float32(weight))
    return jnp.clip(decoded, -_F32_MAX, _F32_MAX), kept


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
    message_bytes: int | None,
) -> tuple[jax.Array, jax.Array | None]:
    """``weight`` times the sum over ``group`` of the flat vectors ``x``, as integer codes.

    Args:
      x: this device's flat float32 vector; its length a multiple of ``block_size``.
      residual: None, or this device's error-feedback residual, same shape as ``x``.
      group: the axis name (or names) that sums.
      group_size: its size.
      weight: scales the decoded sum (1 / devices for a mean).
      block_size: values per grid.
      key: this device's PRNG key for stochastic rounding (None for nearest).
      bits: 8 or 4 (see ``allreduce_width``).
      stochastic: stochastic rounding.
      message_bytes: bytes of codes per psum; None: one psum.

    Returns:
      The decoded weighted sum, typed as replicated over ``group``, and the new residual
      (None without one).
    """
    width = allreduce_width(bits, group_size)
    if residual is not None:
        x = x + residual
    blocks = x.reshape(-1, block_size)
    bounds = jax.lax.pmax(_bounds(blocks), group)
    scale, zero, inv_scale = _grid(bounds, width.levels, stochastic)
    seed = None if key is None else jax.random.bits(key, (2,), jnp.uint32)
    decoded, kept = [], []
    for rows in message_slices(blocks.shape[0], block_size * width.bits // 8, message_bytes):
        uniforms = None
        if seed is not None:
            start = rows.start * block_size
            shape = (rows.stop - rows.start, block_size)
            index = (
                jnp.uint32(start)
                + jax.lax.broadcasted_iota(jnp.uint32, shape, 0) * np.uint32(block_size)
                + jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
            )
            uniforms = dither(seed, index)
        piece, missed = _integer_piece(
            blocks[rows],
            scale=scale[rows],
            zero=zero[rows],
            inv_scale=inv_scale[rows],
            group=group,
            group_size=group_size,
            width=width,
            weight=weight,
            uniforms=uniforms,
            feedback=residual is not None,
        )
        decoded.append(piece)
        kept.append(missed)
    total = jnp.concatenate(decoded).reshape(-1)
    return total, None if residual is None else jnp.concatenate(kept).reshape(-1)


def allreduce_sum_flat(
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
):
    """The integer wire's all-reduce of one flat float32 bucket (``_compressed_sum_flat``'s
    contract): its length a multiple of devices x block; returns the reduced bucket, typed
    as replicated over both axes, and the new residuals, None without error feedback, else
    (send, mean) with ``mean`` empty (one compression, so one residual; ``residual_sizes``).
    ``codec["implementation"]`` is not used: this codec is jnp, which XLA fuses on every
    backend.
    """
    if hierarchical:
        if local > 1:
            x = jax.lax.psum_scatter(x, local_axis, scatter_dimension=0, tiled=True)
        # With one device per node, summing over both axes reaches the same devices and
        # types the result replicated over both.
        group, group_size = (node_axis if local > 1 else (node_axis, local_axis)), n
    else:
        group, group_size = (node_axis, local_axis), n * local
    if group_size == 1:
        # No slow hop to compress: the honest result is the plain float32 one.
        x = x * jnp.float32(weight)
        if hierarchical:
            x = gather_invariant(gather_invariant(x, node_axis), local_axis)
        return x, residual
    send = None if residual is None else residual[0]
    x, send = integer_sum(
        x,
        send,
        group=group,
        group_size=group_size,
        weight=weight,
        block_size=block_size,
        key=key,
        bits=codec["bits"],
        stochastic=codec["stochastic"],
        message_bytes=message_bytes,
    )
    if hierarchical and local > 1:
        x = gather_invariant(x, local_axis)
    return x, None if residual is None else (send, residual[1])


def residual_sizes(padded_sizes, *, num_nodes: int, devices_per_node: int, hierarchical: bool):
    """Per-device (send, mean) residual lengths of the integer wire, one pair per bucket of
    the given padded sizes: one residual of what this device's codes missed, and an empty
    ``mean``; (0, 0) where nothing is compressed."""
    group_size = num_nodes if hierarchical else num_nodes * devices_per_node
    sizes = []
    for padded in padded_sizes:
        send = padded // devices_per_node if hierarchical else padded
        sizes.append((0, 0) if group_size == 1 else (send, 0))
    return tuple(sizes)
