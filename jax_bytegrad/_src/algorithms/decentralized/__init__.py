"""Bagua's decentralized SGD and its low-precision variant: the steps (``step.py``) and their
registry entries (``build.py``)."""

from jax_bytegrad._src.algorithms.decentralized import build as build  # registers
