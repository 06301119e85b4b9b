"""Pure-jnp block-wise 8- and 4-bit min-max quantization: the semantics, and the CPU/TPU path.

Follows the min-max uint8 compression of Bagua's ByteGrad (Gan et al., "Bagua: Scaling up
Distributed Learning with System Relaxations", VLDB 2022), with three changes: the grid is
stored as (scale, zero point) per block so that zero is exact without Bagua's large integer
offsets, extreme magnitudes never overflow, and non-finite blocks decode to NaN.

Every function here works on blocks that are already laid out as rows: ``x`` has shape
``(num_blocks, block_size)``. ``quantization.py`` does the flattening, padding and validation.

Per block, with lo = min and hi = max of the block (in float32), M = 2**bits - 1 the
largest code (255 for 8 bits, 15 for 4 bits):

    scale = max((hi - lo) / D, max(|lo|, |hi|) * 2**-23)     D = M nearest, M - 1 stochastic
    zero  = round(-lo / scale)   (nearest)      ceil(-lo / scale)   (stochastic)
    code  = clip(round(y) + zero, 0, M)                   y = x / scale   (nearest)
            clip(floor(y) + (u < y - floor(y)) + zero, 0, M), u ~ U[0, 1) (stochastic)
    x_hat = clip((code - zero) * scale, -finfo.max, finfo.max)

8-bit codes are one uint8 per value, ``(num_blocks, block_size)``. 4-bit codes are packed two
per byte, ``(num_blocks, block_size // 2)``: byte j of a block holds value j in its low
nibble and value j + block_size // 2 in its high nibble. Pairing the two halves of a block,
rather than neighbours, lets a kernel that holds a block as rows of 128 lanes pack and
unpack with whole-row ref slices and no lane shuffles.

A constant block (lo == hi) is stored as scale = lo, zero = -1 and codes 0, so it decodes
to exactly (0 + 1) * lo; an all-zero block is the case lo == 0.

The header row of a block is ``[scale, zero]`` in float32. Why each piece:

* ``code - zero`` is a small exact integer, so ``x_hat`` is one rounded product. When
  lo <= 0 <= hi, ``zero`` lies in [0, 255], 0 encodes to ``zero`` and decodes to exactly 0:
  sparse gradients stay sparse.
* The ``2**-23`` floor keeps |zero| <= 2**23, so ``code - zero`` stays exact in float32 even
  for a block like [1000, 1000.0001] whose range is a few ulps of its magnitude; there the
  error is at most max(|lo|, |hi|) * 2**-24 (one ulp) instead of (hi - lo) / (2 M). It also
  costs nothing elsewhere: when lo <= 0 <= hi the range term is always the larger.
* ``(hi - lo) / D`` is computed as ``hi / D - lo / D`` so that +-3e38 in one block does not
  overflow; the final clip keeps a grid point just past +-finfo.max finite.
* Nearest rounding: the grid covers [lo, hi] to within scale / 2, so
  |x_hat - x| <= (hi - lo) / (2 M) plus float rounding: / 510 for 8 bits, / 30 for 4.
* Stochastic rounding: D = M - 1 and ``ceil`` make the grid contain [lo, hi], so clipping
  never biases; E[x_hat] = x. Comparing u with the exact fraction of y, rather than
  flooring y + u, keeps it unbiased where |y| nears 2**23 and float32 has no room for u.
* A block holding NaN or +-inf gets scale = NaN and codes 0: it decodes to NaN everywhere.
* Subnormal magnitudes below
  ``finfo(float32).tiny * 2**-23`` may decode to 0 (GPUs flush them anyway).
"""

import jax
import jax.numpy as jnp
import numpy as np

# Keeps |zero| <= 2**23 so that code - zero is an exact float32 integer.
_SCALE_FLOOR = 2.0**-23
_F32_MAX = float(jnp.finfo(jnp.float32).max)
BITS = (8, 4)


def max_code(bits: int) -> float:
    """The largest code of a ``bits``-wide grid: 255 or 15."""
    return float(2**bits - 1)


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Packs (..., block_size) codes < 2**bits into bytes; see the module docstring."""
    if bits == 8:
        return codes
    half = codes.shape[-1] // 2
    return codes[..., :half] | (codes[..., half:] << 4)


def unpack(codes: jax.Array, bits: int) -> jax.Array:
    """Inverse of ``pack``: one uint8 code per value."""
    if bits == 8:
        return codes
    return jnp.concatenate([codes & 15, codes >> 4], axis=-1)


def _scale_and_zero(lo: jax.Array, hi: jax.Array, stochastic: bool, bits: int):
    levels = max_code(bits) - 1.0 if stochastic else max_code(bits)
    magnitude = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    scale = jnp.maximum(hi / levels - lo / levels, magnitude * _SCALE_FLOOR)
    inv_scale = jnp.where(scale > 0, 1.0 / scale, 0.0)
    shift = -lo * inv_scale
    zero = jnp.ceil(shift) if stochastic else jnp.round(shift)
    constant = hi == lo
    scale = jnp.where(constant, lo, scale)
    zero = jnp.where(constant, -1.0, zero)
    finite = jnp.isfinite(lo) & jnp.isfinite(hi)
    scale = jnp.where(finite, scale, jnp.nan)
    zero = jnp.where(finite, zero, 0.0)
    inv_scale = jnp.where(finite & ~constant, inv_scale, 0.0)
    return scale, zero, inv_scale


def _block_range(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Min and max of each row in one pass (one variadic reduce; NaN propagates)."""
    lo, hi = jax.lax.reduce(
        (x, x),
        (np.float32(np.inf), np.float32(-np.inf)),
        lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])),
        (1,),
    )
    return lo[:, None], hi[:, None]


def _encode(x, lo, hi, *, stochastic: bool, key, bits: int):
    scale, zero, inv_scale = _scale_and_zero(lo, hi, stochastic, bits)
    y = x * inv_scale
    if stochastic:
        u = jax.random.uniform(key, x.shape, jnp.float32)
        floor = jnp.floor(y)
        y = floor + (u < y - floor).astype(jnp.float32)
    else:
        y = jnp.round(y)
    # Non-finite x gives NaN here; those blocks have zero = 0 and decode to NaN via the scale.
    y = jnp.where(jnp.isnan(y), 0.0, y)
    codes = jnp.clip(y + zero, 0.0, max_code(bits)).astype(jnp.uint8)
    header = jnp.concatenate([scale, zero], axis=1)
    return pack(codes, bits), header


def quantize_blocks(
    x: jax.Array, *, stochastic: bool = False, key: jax.Array | None = None, bits: int = 8
) -> tuple[jax.Array, jax.Array]:
    """Quantizes rows of ``x`` (num_blocks, block_size) to uint8 codes and a (blocks, 2) header.

    The codes are (num_blocks, block_size * bits // 8): packed two per byte for 4 bits.
    """
    x = x.astype(jnp.float32)
    lo, hi = _block_range(x)
    return _encode(x, lo, hi, stochastic=stochastic, key=key, bits=bits)


def dequantize_blocks(codes: jax.Array, header: jax.Array, *, bits: int = 8) -> jax.Array:
    """Decodes (num_blocks, block_size * bits // 8) uint8 codes with their header to float32."""
    scale = header[:, 0:1]
    zero = header[:, 1:2]
    x = (unpack(codes, bits).astype(jnp.float32) - zero) * scale
    return jnp.clip(x, -_F32_MAX, _F32_MAX)


def _weighted_sum(codes: jax.Array, header: jax.Array, weight: float, bits: int) -> jax.Array:
    # Slice by slice: XLA on CPU reduces a leading axis several times slower than it adds.
    total = None
    for i in range(codes.shape[0]):
        weighted = header[i] * jnp.asarray([[weight, 1.0]], jnp.float32)
        part = dequantize_blocks(codes[i], weighted, bits=bits)
        total = part if total is None else total + part
    return total


def average_requantize(
    codes: jax.Array,
    header: jax.Array,
    *,
    weight: float,
    stochastic: bool = False,
    key: jax.Array | None = None,
    bits: int = 8,
) -> tuple[jax.Array, jax.Array]:
    """Decodes n chunks, sums them times ``weight`` in float32, and quantizes the result.

    ``codes`` is (n, num_blocks, block_size * bits // 8) and ``header`` (n, num_blocks, 2).
    The weight is folded into each chunk's scale, so a mean of values near finfo.max does not
    overflow.

    The float32 sum is computed twice, once for the block ranges and once for the encode,
    instead of being written to memory in between: decoding n bytes per element is cheaper
    than writing and re-reading 4 (benchmarks/RESULTS.md, "Sync"). The barrier keeps XLA
    from merging the two computations back into one stored intermediate; the values are the
    same.
    """
    lo, hi = _block_range(_weighted_sum(codes, header, weight, bits))
    codes, header, lo, hi = jax.lax.optimization_barrier((codes, header, lo, hi))
    total = _weighted_sum(codes, header, weight, bits)
    return _encode(total, lo, hi, stochastic=stochastic, key=key, bits=bits)
