"""Bagua's asynchronous model averaging: the step (``step.py``) and its registry entry
(``build.py``)."""

from jax_bytegrad._src.algorithms.asynchronous import build as build  # registers
