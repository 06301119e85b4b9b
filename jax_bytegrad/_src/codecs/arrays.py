"""Block-wise 8-, 4- and 2-bit min-max quantization: ``QuantizedArray``, ``quantize``,
``dequantize``.

Follows the min-max uint8 codec of Bagua's ByteGrad (Gan et al., VLDB 2022), and adds a
4-bit grid packed two codes per byte, as ZeRO++'s qgZ sends gradients, and a 2-bit grid
packed four per byte (the XLA reference only). The numeric
semantics live in ``codecs/reference.py``; this module validates arguments, lays arrays out
as blocks, and runs the block ops of ``codecs`` with one ``codecs.Codec`` (bits, rounding and
implementation: the XLA reference, the compiled Mosaic GPU kernels or the interpreted ones,
chosen per kernel for ``implementation=None``). The ops the wires compose (``average_blocks``,
``quantize_with_feedback``) live with the codecs, which the wires speak to alone.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src import checks
from jax_bytegrad._src import codecs as _codecs
from jax_bytegrad._src.codecs import HEADER_WIDTH as HEADER_WIDTH
from jax_bytegrad._src.codecs import Codec, Implementation, check_key, resolve_implementation
from jax_bytegrad._src.codecs.widths import BITS, ROUNDINGS, Bits, Rounding, check_block_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """An array quantized block by block to uint8 codes between each block's min and max.

    Attributes:
      codes: uint8 array of shape (num_blocks, block_size * bits // 8): one code per byte
        at 8 bits, two per byte at 4 bits, four at 2.
      header: float32 array of shape (num_blocks, 2): each block's [scale, zero point].
      shape: the original shape (static).
      dtype: the original dtype (static).
      bits: bits per code, 8, 4 or 2 (static).
    """

    codes: jax.Array
    header: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))
    bits: int = dataclasses.field(default=8, metadata=dict(static=True))

    @property
    def block_size(self) -> int:
        return self.codes.shape[-1] * 8 // self.bits

    @property
    def num_blocks(self) -> int:
        return self.codes.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes of codes plus headers: what crosses the wire."""
        return self.codes.size * 1 + self.header.size * 4


def quantize(
    x: jax.typing.ArrayLike,
    *,
    bits: Bits = 8,
    block_size: int | None = None,
    rounding: Rounding = "nearest",
    key: jax.Array | None = None,
    implementation: Implementation | None = None,
) -> QuantizedArray:
    """Quantizes an array block by block to 8-, 4- or 2-bit codes between each block's min and max.

    The array is flattened and cut into blocks of ``block_size`` elements; the tail block is
    padded with copies of its last element, which changes neither its min nor its max, and
    the padding never reaches the output of ``dequantize``. Each block's 2**bits levels span
    its [min, max], with zero kept exactly on the grid whenever min <= 0 <= max. 4-bit codes
    are packed two per byte, 2-bit codes four.

    Guarantees (``dequantize(quantize(x))`` as x_hat, per block with lo = min, hi = max,
    M = 2**bits - 1):
      * nearest rounding: |x_hat - x| <= (hi - lo) / (2 M), plus float rounding;
      * stochastic rounding: E[x_hat] = x over keys;
      * a constant block (all-zero included) decodes exactly; 0 decodes to exactly 0
        whenever lo <= 0 <= hi;
      * finite input never decodes to inf or NaN, up to the dtype's largest value;
      * a block holding NaN or +-inf decodes to NaN in every element.

    Args:
      x: a float32, bfloat16 or float16 array of any shape, size 0 included.
      bits: bits per code, 8, 4 or 2 (2 bits: the XLA reference only, no kernel).
      block_size: elements per block; a power of two >= 128 (>= 256 for 4 bits, >= 512 for
        2), or None for the default of ``bits`` (1024 at 8 bits, 512 at 4 and 2).
      rounding: ``"nearest"`` or ``"stochastic"`` (unbiased; needs ``key``).
      key: a PRNG key, for stochastic rounding only.
      implementation: ``"xla"``, ``"pallas"`` (the kernel compiled by Mosaic GPU, for NVIDIA
        GPUs of compute capability >= 9.0; it also lowers and exports for CUDA from a host
        without a GPU), ``"pallas_interpret"`` (the same kernel in the Pallas interpreter,
        any backend), or None for the best available, per kernel: XLA except on a supported
        GPU, where each compiled kernel is used once it has reproduced XLA on a small input
        (see ``docs/gpu.md``).

    Returns:
      A ``QuantizedArray`` holding uint8 codes (num_blocks, block_size * bits // 8), the
      float32 header (num_blocks, 2), and the original shape, dtype and bits as static data.

    Raises:
      ValueError: for a non-float dtype, a bad ``bits``, ``block_size`` or ``rounding``, or a
        missing or superfluous ``key``.
      NotImplementedError: for ``implementation="pallas"`` on a GPU older than Hopper, or
        when the computation is lowered for a platform other than CUDA (running it on a
        CPU, say); for a Pallas implementation at 2 bits, which has no kernel.

    Examples:
      >>> import jax.numpy as jnp, jax_bytegrad
      >>> q = jax_bytegrad.quantize(jnp.linspace(-1.0, 1.0, 1000), block_size=256)
      >>> q.codes.shape, q.header.shape
      ((4, 256), (4, 2))
      >>> x_hat = jax_bytegrad.dequantize(q)
      >>> bool(jnp.max(jnp.abs(x_hat - jnp.linspace(-1.0, 1.0, 1000))) <= 2.0 / 510)
      True
      >>> jax_bytegrad.quantize(jnp.ones(1000), bits=4, block_size=256).codes.shape
      (4, 128)

    References:
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    x = jnp.asarray(x)
    if x.dtype not in checks.FLOAT_DTYPES:
        raise ValueError(
            f"quantize: dtype must be float32, bfloat16 or float16, got {x.dtype}; "
            "cast the array first"
        )
    checks.one_of(bits, BITS, "bits", "quantize")
    block_size = check_block_size(block_size, "quantize", bits)
    checks.one_of(rounding, ROUNDINGS, "rounding", "quantize")
    stochastic = rounding == "stochastic"
    check_key(stochastic, key, "quantize")
    implementation = resolve_implementation(implementation)
    codec = Codec(bits=bits, stochastic=stochastic, implementation=implementation)
    num_blocks = -(-x.size // block_size)
    flat = x.reshape(-1)
    pad = num_blocks * block_size - x.size
    if pad and x.size:
        flat = jnp.pad(flat, (0, pad), mode="edge")
    blocks = flat.reshape(num_blocks, block_size)
    codes, header = _codecs.quantize_blocks(codec, blocks, key)
    return QuantizedArray(
        codes=codes, header=header, shape=tuple(x.shape), dtype=x.dtype, bits=bits
    )


def dequantize(q: QuantizedArray, *, implementation: Implementation | None = None) -> jax.Array:
    """Decodes a ``QuantizedArray`` back to its original shape and dtype.

    Values are computed in float32 and clipped to the dtype's finite range before the cast,
    so finite input never comes back as inf; blocks that held NaN or inf come back as NaN.

    Args:
      q: the output of ``quantize``.
      implementation: as in ``quantize``.

    Returns:
      An array of ``q.shape`` and ``q.dtype``.

    Raises:
      ValueError: if ``q`` is not a ``QuantizedArray``.
      NotImplementedError: as in ``quantize``.

    Examples:
      >>> import jax.numpy as jnp, jax_bytegrad
      >>> x = jnp.array([0.0, 0.5, -2.0, 0.0], jnp.bfloat16)
      >>> jax_bytegrad.dequantize(jax_bytegrad.quantize(x, block_size=128))
      Array([0, 0.5, -2, 0], dtype=bfloat16)

    References:
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    if not isinstance(q, QuantizedArray):
        raise ValueError(f"dequantize: expected a QuantizedArray, got {type(q).__name__}")
    codec = Codec(bits=q.bits, implementation=resolve_implementation(implementation))
    values = _codecs.dequantize_blocks(codec, q.codes, q.header)
    size = int(np.prod(q.shape, dtype=np.int64))
    values = values.reshape(-1)[:size]
    finite_max = float(jnp.finfo(q.dtype).max)
    values = jnp.clip(values, -finite_max, finite_max).astype(q.dtype)
    return values.reshape(q.shape)
