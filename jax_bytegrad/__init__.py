"""jax_bytegrad: data-parallel training in JAX with 8-bit compressed traffic between nodes."""

from jax_bytegrad.quantize import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from jax_bytegrad.quantize import QuantizedArray as QuantizedArray
from jax_bytegrad.quantize import dequantize as dequantize
from jax_bytegrad.quantize import quantize as quantize

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "QuantizedArray",
    "dequantize",
    "quantize",
]
