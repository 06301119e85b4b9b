"""Pure-jnp block-wise 8-, 4- and 2-bit min-max quantization: the semantics, the CPU/TPU path.

Follows the min-max uint8 compression of Bagua's ByteGrad (Gan et al., "Bagua: Scaling up
Distributed Learning with System Relaxations", VLDB 2022), with three changes: the grid is
stored as (scale, zero point) per block so that zero is exact without Bagua's large integer
offsets, extreme magnitudes never overflow, and non-finite blocks decode to NaN.

Every function here works on blocks that are already laid out as rows: ``x`` has shape
``(num_blocks, block_size)``. ``arrays.py`` does the flattening, padding and validation.
Each takes a ``codecs.Codec`` first (its ``bits`` and rounding), then its arrays; every other
implementation of the same op (``pallas.py``) takes the same arguments.

Each block is coded on the grid of ``grid.py`` (its module docstring has the formulas):
lo = min and hi = max of the block in float32, and M = 2**bits - 1 levels, the largest code
(255 for 8 bits, 15 for 4 bits, 3 for 2 bits), with D = M steps for nearest rounding and M - 1 for
stochastic rounding.

8-bit codes are one uint8 per value, ``(num_blocks, block_size)``. 4-bit codes are packed two
per byte, ``(num_blocks, block_size // 2)``: byte j of a block holds value j in its low
nibble and value j + block_size // 2 in its high nibble. Pairing the two halves of a block,
rather than neighbours, lets a kernel that holds a block as rows of 128 lanes pack and
unpack with whole-row ref slices and no lane shuffles. 2-bit codes go four per byte the same
way, ``(num_blocks, block_size // 4)``: byte j holds value j + i * block_size // 4 at bit
2 i, for i = 0..3 (the XLA reference only: no kernel).

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

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src.codecs import grid as _grid
from jax_bytegrad._src.codecs import widths


def pack(codes: jax.Array, bits: int) -> jax.Array:
    """Packs (..., block_size) codes < 2**bits into bytes, ``8 // bits`` per byte: byte j
    holds code j + i * (block_size // per_byte) at bit i * bits (module docstring)."""
    per_byte = widths.FORMATS[bits].per_byte
    if per_byte == 1:
        return codes
    part = codes.shape[-1] // per_byte
    packed = codes[..., :part]
    for i in range(1, per_byte):
        packed = packed | (codes[..., i * part : (i + 1) * part] << (i * bits))
    return packed


def unpack(codes: jax.Array, bits: int) -> jax.Array:
    """Inverse of ``pack``: one uint8 code per value."""
    per_byte = widths.FORMATS[bits].per_byte
    if per_byte == 1:
        return codes
    mask = np.uint8(2**bits - 1)
    # The first part needs no shift and the last no mask: the same ops as ever at 4 bits.
    parts = [codes & mask]
    parts += [(codes >> (i * bits)) & mask for i in range(1, per_byte - 1)]
    parts.append(codes >> ((per_byte - 1) * bits))
    return jnp.concatenate(parts, axis=-1)


def _block_range(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Min and max of each row in one pass (one variadic reduce; NaN propagates)."""
    lo, hi = jax.lax.reduce(
        (x, x),
        (np.float32(np.inf), np.float32(-np.inf)),
        lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1])),
        (1,),
    )
    return lo[:, None], hi[:, None]


def _encode(codec, x, lo, hi, key):
    levels = _grid.max_code(codec.bits)
    scale, zero, inv_scale = _grid.grid(lo, hi, levels=levels, stochastic=codec.stochastic)
    u = jax.random.uniform(key, x.shape, jnp.float32) if codec.stochastic else None
    codes = _grid.codes(x * inv_scale, zero, levels, u).astype(jnp.uint8)
    header = jnp.concatenate([scale, zero], axis=1)
    return pack(codes, codec.bits), header


def quantize_blocks(codec, x: jax.Array, key: jax.Array | None = None):
    """Quantizes rows of ``x`` (num_blocks, block_size) to uint8 codes and a (blocks, 2) header.

    Args:
      codec: a ``codecs.Codec``: its ``bits`` and ``stochastic`` rounding (which needs ``key``).
      x: float32, bfloat16 or float16 blocks.
      key: a PRNG key for stochastic rounding, else None.

    Returns:
      ``(codes, header)``: codes (num_blocks, block_size * bits // 8), packed two per byte
      for 4 bits; the header's rows are ``[scale, zero]`` in float32.
    """
    x = x.astype(jnp.float32)
    lo, hi = _block_range(x)
    return _encode(codec, x, lo, hi, key)


def dequantize_blocks(codec, codes: jax.Array, header: jax.Array) -> jax.Array:
    """Decodes (num_blocks, block_size * bits // 8) uint8 codes with their header to float32."""
    scale = header[:, 0:1]
    zero = header[:, 1:2]
    return _grid.decode(unpack(codes, codec.bits).astype(jnp.float32), zero, scale)


def weighted_sum(decode, codes: jax.Array, header: jax.Array, weight: float) -> jax.Array:
    """``weight`` times the sum of n chunks, each decoded by ``decode(codes, header)``.

    The weight is folded into each chunk's scale, so a mean of values near finfo.max does not
    overflow, and the chunks are added in order 0..n-1, so every caller rounds the same way.
    Slice by slice: XLA on CPU reduces a leading axis several times slower than it adds.
    """
    total = None
    for i in range(codes.shape[0]):
        weighted = header[i] * jnp.asarray([[weight, 1.0]], jnp.float32)
        part = decode(codes[i], weighted)
        total = part if total is None else total + part
    return total


def average_requantize(
    codec, codes: jax.Array, header: jax.Array, key: jax.Array | None = None, *, weight: float
) -> tuple[jax.Array, jax.Array]:
    """Decodes n chunks, sums them times ``weight`` in float32, and quantizes the result.

    ``codes`` is (n, num_blocks, block_size * bits // 8) and ``header`` (n, num_blocks, 2);
    ``codec`` and ``key`` as in ``quantize_blocks``. The weight is folded into each chunk's
    scale (``weighted_sum``).

    The float32 sum is computed twice, once for the block ranges and once for the encode,
    instead of being written to memory in between: decoding n bytes per element is cheaper
    than writing and re-reading 4 (benchmarks/RESULTS.md, "Sync"). The barrier keeps XLA
    from merging the two computations back into one stored intermediate; the values are the
    same.
    """
    decode = functools.partial(dequantize_blocks, codec)
    lo, hi = _block_range(weighted_sum(decode, codes, header, weight))
    codes, header, lo, hi = jax.lax.optimization_barrier((codes, header, lo, hi))
    total = weighted_sum(decode, codes, header, weight)
    return _encode(codec, total, lo, hi, key)
