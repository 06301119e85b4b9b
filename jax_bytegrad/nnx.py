"""Flax NNX models trained by a ``Strategy``: ``train_step`` in place of ``nnx.Optimizer``.

Needs Flax (``pip install -e '.[examples]'``); ``import jax_bytegrad`` does not import it.
See docs/flax.md.
"""

from jax_bytegrad._src.nnx import NNXTrainStep as NNXTrainStep
from jax_bytegrad._src.nnx import train_step as train_step

__all__ = ["NNXTrainStep", "train_step"]
