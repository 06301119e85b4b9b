"""QAdam (Bagua's QAdam, after 1-bit Adam): the transform (``transform.py``), its phase
schedule (``schedule.py``) and its registry entry (``build.py``)."""

from jax_bytegrad._src.algorithms.qadam import build as build  # registers
