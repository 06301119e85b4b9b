"""The integer wire's codec: codes on a grid the group shares, which add up as integers.

Follows the THC and IntSGD family (Li et al., "THC: Accelerating Distributed Deep Learning
Using Tensor Homomorphic Compression", NSDI 2024; Mishchenko et al., "IntSGD: Adaptive
Floatless Compression of Stochastic Gradients", ICLR 2022). Every device of a group of g
quantizes onto the same grid per block, with headroom, so the group's codes sum exactly in one
integer ``psum``; ``wire.integer_stages`` holds the stages around the collective, which the
one-program sync runs inline and the pipelined step as programs of their own.

Its four stages (``integer_bounds``, ``integer_encode``, ``decode_factors``,
``integer_decode``) are ops of the codec registry (``codecs/__init__.py``) with one
implementation, ``"xla"``: XLA fuses each into one pass over memory, which no kernel could
make move fewer bytes (docs/gpu.md, "Which codec runs on GPU"); asking them for ``"pallas"``
raises ``NotImplementedError``.

The grid of a block is ``grid.py``'s rule, from the group's lo = min and hi = max (every
device computes it from the same pmax, so every device holds the same grid), with L levels per
device:

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
refused beyond. The rule: uint8 while the error of the mean stays below half that of the
4-bit scatter-gather wire, which trains within a point of float32 (benchmarks/RESULTS.md,
"Widths: levels per device against the error of the mean").

XLA:CPU contracts a product that feeds an add into one fused multiply-add when both land in
one fusion, and copies small per-block computations into every fusion that reads them; so
no product here feeds an add (exact halves, or a clip in between), or the bits would depend
on the fusions and so on the message split.

That copying also costs time: the decode is fused into each optimizer pass that reads the
mean, which walks the leaf's shape, not the blocks, so the grid's operations would run once
per value in every such pass (benchmarks/RESULTS.md, "Decode factors: each block's grid once,
not once per value"). The decode's two factors per block, ``scale * weight`` and ``g * zero``,
are therefore computed once (``decode_factors``) and go through a ``pmax`` over the group:
they are the same on every device, so the pmax changes no bit, and XLA reads a collective's
result as data instead of recomputing it.

Error feedback keeps one residual per device: what its codes failed to carry,
``x + residual - (code - zero) * scale``. Summed over the group, the residuals and the
decoded sum give back the sum of ``x + residual`` exactly where float32 allows.

Non-finite values stay visible: a block holding NaN or +-inf on any device has its bound
set to +inf there, the pmax spreads it, and every device decodes that block to NaN, the
whole block, for every device's contribution, as a float32 psum would.
"""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src.codecs import grid as _grid

# Largest group whose sum fits each width with enough levels per device (module docstring).
# 2-bit codes have 3 levels: any group of 2 or more would leave fewer than 2 each.
MAX_GROUP = {8: 8, 4: 2, 2: 1}
# The width a code widens to beyond ``MAX_GROUP`` (only bytes widen: packed codes would carry).
WIDER = {8: 16}
# Why a width is refused on the integer wire beyond ``MAX_GROUP``.
_LIMIT = {
    4: "their nibbles must not carry",
    2: "3 levels leave fewer than 2 per device for any group of 2 or more",
}


@dataclasses.dataclass(frozen=True)
class Width:
    """How the integer wire sends codes for a group of devices.

    Attributes:
      bits: bits per code on the wire: 4 (two per byte), 8 or 16.
      levels: L, the largest code one device sends; group size x L < 2**bits.
    """

    bits: int
    levels: int


def fits(bits: int, group_size: int) -> bool:
    """Whether ``bits``-bit codes of ``group_size`` devices can be summed on the integer wire:
    8-bit codes always (uint16 beyond ``MAX_GROUP[8]``), 4-bit nibbles up to ``MAX_GROUP[4]``
    devices, whose sum must not carry from one nibble into the next; 2-bit codes never in a
    group of more than one."""
    return bits in WIDER or group_size <= MAX_GROUP[bits]


def check_fits(bits: int, group_size: int, where: str = "wire='allreduce'") -> None:
    """Raises unless ``fits(bits, group_size)``, naming ``where`` and what to pass instead.

    Raises:
      ValueError: for 4-bit codes over more than ``MAX_GROUP[4]`` devices, or 2-bit codes
        over more than one.
    """
    if not fits(bits, group_size):
        most = MAX_GROUP[bits]
        raise ValueError(
            f"{where}: {bits}-bit codes sum over at most {most} device{'s' * (most != 1)} on "
            f"wire='allreduce' ({_LIMIT[bits]}), got {group_size}; pass "
            f"wire='scatter_gather' (which wire='auto' picks) for {bits} bits, or bits=8"
        )


def allreduce_width(bits: int, group_size: int, platform: str | None = None) -> Width:
    """The wire width and levels per device of the integer wire for ``group_size`` devices.

    On a GPU (``platform="gpu"``) a uint16 width warns: XLA:GPU promotes 16-bit integer
    all-reduces to 32 bits, float32's bytes. Python's warning registry shows it once per
    group size (the message names it) under the default filters.

    Args:
      bits: the code width asked for, 8 or 4.
      group_size: how many devices sum their codes (the node count, or every device with
        ``hierarchical=False``).
      platform: the mesh's JAX platform, or None where it is not known.

    Returns:
      A ``Width``: uint8 for 8 bits up to 8 devices, uint16 beyond; packed nibbles for 4
      bits up to 2 devices.

    Raises:
      ValueError: for 4 bits over more than 2 devices, or a group too large for uint16.

    Examples:
      >>> allreduce_width(8, 2), allreduce_width(8, 16), allreduce_width(4, 2)
      (Width(bits=8, levels=127), Width(bits=16, levels=4095), Width(bits=4, levels=7))
    """
    check_fits(bits, group_size)
    width = bits if group_size <= MAX_GROUP[bits] else WIDER[bits]
    levels = (2**width - 1) // group_size
    if levels < 2:
        raise ValueError(
            f"wire='allreduce': {group_size} devices leave fewer than 2 levels each in uint16; "
            "pass wire='scatter_gather'"
        )
    if width == 16 and platform == "gpu":
        warnings.warn(
            f"jax_bytegrad: wire='allreduce' sums the codes of {group_size} devices as uint16 "
            "(more than 8 summing devices), and XLA:GPU promotes 16-bit integer all-reduces to "
            "32 bits: this sync costs as many bytes as a float32 all-reduce here. Pass "
            "wire='scatter_gather' (8-bit codes at any group size), or hierarchical=True with "
            "at most 8 nodes",
            RuntimeWarning,
            stacklevel=1,
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


def _unfused_step(lo, hi, steps):
    """``(hi - lo) / steps`` with no product feeding an add (module docstring): the halves
    are exact products, so a contracted hi * 0.5 - lo * 0.5 rounds the same; they keep
    +-3e38 in one block from overflowing."""
    span = hi - lo
    return jnp.where(
        jnp.isfinite(span),
        span * np.float32(1 / steps),
        (hi * np.float32(0.5) - lo * np.float32(0.5)) * np.float32(2 / steps),
    )


# The grid rule of grid.py, with this wire's spelling of the range step.
_SPELLING = _grid.Spelling(step=_unfused_step)


def grid(bounds: jax.Array, levels: int, stochastic: bool):
    """Scale, integer zero point and 1 / scale per block, shape (blocks, 1), from the bounds
    (``integer_bounds``): ``grid.grid`` of lo = -bounds[:, 1], hi = bounds[:, 0]."""
    hi, lo = bounds[:, 0:1], -bounds[:, 1:2]
    return _grid.grid(lo, hi, levels=levels, stochastic=stochastic, spelling=_SPELLING)


# The integer wire's stages, as ops of the codec registry (``codecs/__init__.py``): each takes
# the ``Codec`` first, as every op does, and reads what it needs of it.


def integer_bounds(codec, x: jax.Array, block_size: int) -> jax.Array:
    """The integer wire's first stage: each block's [max, -min] of the flat vector ``x``
    (after adding the residual), shape (blocks, 2), both +inf for a block holding NaN or
    +-inf; the group then agrees on them with one ``pmax``. The same for every ``codec``.

    Max of (x, -x) in one variadic reduce; NaN propagates through it and is then made +inf,
    which a pmax spreads to every device (a NaN may not survive a max through Gloo).
    """
    del codec
    blocks = x.reshape(-1, block_size)
    hi, neg_lo = jax.lax.reduce(
        (blocks, -blocks),
        (np.float32(-np.inf), np.float32(-np.inf)),
        lambda a, b: (jnp.maximum(a[0], b[0]), jnp.maximum(a[1], b[1])),
        (1,),
    )
    bounds = jnp.stack([hi, neg_lo], axis=1)
    finite = jnp.isfinite(hi) & jnp.isfinite(neg_lo)
    return jnp.where(finite[:, None], bounds, np.float32(np.inf))


def integer_encode(codec, x, bounds, *, block_size, width, seed, first_block=0,
                   feedback):  # fmt: skip
    """The integer wire's second stage: codes of the flat vector ``x`` on the group's grid.

    Args:
      codec: its rounding: the grid of stochastic rounding (``seed`` draws the dither), or of
        nearest rounding (``width`` stands for its bits).
      x: this device's values (residual added), a whole number of blocks.
      bounds: the group's ``pmax`` of ``integer_bounds`` for these blocks.
      block_size: values per block.
      width: ``allreduce_width`` of the group.
      seed: None (nearest rounding), or this device's (2,) uint32 seed.
      first_block: the index of ``x``'s first block in its bucket: the dither is a function
        of the element's index in the bucket, so any split of a bucket sends the same codes.
      feedback: also return what the codes missed (error feedback's new residual).

    Returns:
      The codes as the wire sends them, (blocks, block_size) of ``width``'s dtype, or 4-bit
      codes two per byte, (blocks, block_size / 2): each even-indexed value in the low
      nibble and the value after it in the high one, so the byte-wise psum sums each nibble;
      and the flat residual (None without ``feedback``).
    """
    blocks = x.reshape(-1, block_size)
    scale, zero, inv_scale = grid(bounds, width.levels, codec.stochastic)
    uniforms = None
    if seed is not None:
        rows = jax.lax.broadcasted_iota(jnp.uint32, blocks.shape, 0)
        if first_block:
            rows = rows + np.uint32(first_block)
        index = rows * np.uint32(block_size) + jax.lax.broadcasted_iota(jnp.uint32, blocks.shape, 1)
        uniforms = dither(seed, index)
    # Codes on the grid, float32 integers in [0, levels]. |y| <= 2**23 + levels on the grid:
    # the clip changes no value, and keeps the product from being contracted with
    # ``y - floor`` (module docstring).
    y = jnp.clip(blocks * inv_scale, np.float32(-(2.0**24)), np.float32(2.0**24))
    codes = _grid.codes(y, zero, np.float32(width.levels), uniforms)
    kept = None
    if feedback:
        # The clip stands between the product and the subtraction: no fused multiply-add
        # (module docstring), the same residual for any split.
        kept = (blocks - _grid.decode(codes, zero, scale)).reshape(-1)
    if width.bits == 4:
        # Adjacent pairs, not the codec's halves of a block (``codecs.reference.pack``):
        # XLA:CPU fuses the encode into adjacent pairs 1.9x as fast as into halves
        # (benchmarks/RESULTS.md, "Two layouts of the integer wire").
        pairs = codes.astype(jnp.uint8).reshape(codes.shape[0], -1, 2)
        return pairs[..., 0] | (pairs[..., 1] << 4), kept
    return codes.astype(jnp.uint16 if width.bits == 16 else jnp.uint8), kept


def decode_factors(codec, bounds, *, width, group_size, weight) -> jax.Array:
    """The decode's factors per block from the group's bounds, shape (2, blocks) int32:
    the float32 bits of ``scale * weight``, and ``g * zero``, on ``codec``'s grid.

    One int32 array, so that the group agrees on both with one exact ``pmax`` (module
    docstring: the factors then reach every fused decode as data). Each factor is a
    contiguous row: read from (blocks, 2) pairs, an Adam pass with the decode fused in took
    1.4x as long on one core (benchmarks/RESULTS.md, "Two layouts of the integer wire").
    """
    scale, zero, _ = grid(bounds, width.levels, codec.stochastic)
    # |zero| <= 2**23 + 1 and g <= 2**16 / levels: g * zero fits int32.
    offset = (np.int32(group_size) * zero.astype(jnp.int32)).astype(jnp.int32)
    factor = jax.lax.bitcast_convert_type(scale * np.float32(weight), jnp.int32)
    return jnp.stack([factor[:, 0], offset[:, 0]])


def integer_decode(codec, total, factors, *, width) -> jax.Array:
    """The integer wire's last stage: ``weight`` times the decoded sum of the group's codes.

    ``total`` is the ``psum`` of ``integer_encode``'s codes, ``factors`` the group's
    ``decode_factors`` of the same blocks (they hold all of ``codec`` that it needs).
    Returns the flat float32 values.
    """
    del codec
    factor = jax.lax.bitcast_convert_type(factors[0], jnp.float32)[:, None]
    offset = factors[1][:, None]
    total = total.astype(jnp.int32)
    if width.bits == 4:
        # Each byte's two nibbles, low first: the codes' adjacent pairs (``integer_encode``).
        nibbles = (total[..., None] >> np.array([[[0, 4]]], np.int32)) & 15
        total = nibbles.reshape(total.shape[0], -1)
    # sum - g * zero is exact in int32 (g * levels < 2**16); the one rounding to float32 and
    # the one product are the same on every device.
    decoded = (total - offset).astype(jnp.float32) * factor
    return jnp.clip(decoded, -_grid.F32_MAX, _grid.F32_MAX).reshape(-1)


def dither_seed(key: jax.Array) -> jax.Array:
    """The (2,) uint32 seed of ``dither`` from a device's PRNG key for one bucket."""
    return jax.random.bits(key, (2,), jnp.uint32)
