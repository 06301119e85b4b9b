"""Quantization codecs: the jnp reference (owns the semantics) and the Pallas kernels."""
