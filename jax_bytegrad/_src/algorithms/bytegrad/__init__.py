"""ByteGrad (Bagua's ByteGrad, as ``gradient_allreduce`` without compression): the
data-parallel transforms' registry entries (``build.py``) and the pipelined step that runs
the sync's codec beside its wire (``pipelined.py``, ``stages.py``)."""

from jax_bytegrad._src.algorithms.bytegrad import build as build  # registers
