"""Pallas GPU kernels for block-wise 8-bit quantization (being written; see quantize.py)."""

import jax


def is_supported() -> bool:
    """Whether compiled Pallas kernels can run on the default backend."""
    return False


def quantize_blocks(x, *, stochastic, key, interpret):
    raise NotImplementedError("Pallas kernels are not available yet")


def dequantize_blocks(codes, header, *, interpret):
    raise NotImplementedError("Pallas kernels are not available yet")


def average_requantize(codes, header, *, weight, stochastic, key, interpret):
    raise NotImplementedError("Pallas kernels are not available yet")


del jax
