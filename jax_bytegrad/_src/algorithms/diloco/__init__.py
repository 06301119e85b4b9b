"""DiLoCo on ByteGrad's wire: the step (``step.py``), its outer exchange (``exchange.py``) and
schedule (``schedule.py``), ``autotune``'s estimate of what it would gain (``estimate.py``),
and its registry entry (``build.py``)."""

from jax_bytegrad._src.algorithms.diloco import build as build  # registers
