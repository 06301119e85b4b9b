"""Interfaces that may still change: asynchronous model averaging, the pipelined sync alone,
and the collective patterns and residual sizes the benchmarks measure."""

from jax_bytegrad._src.algorithms.asynchronous.step import AsyncModelAverage as AsyncModelAverage
from jax_bytegrad._src.algorithms.asynchronous.step import (
    async_model_average as async_model_average,
)
from jax_bytegrad._src.algorithms.bytegrad.pipelined import PipelinedMean as PipelinedMean
from jax_bytegrad._src.sync.collectives import residual_sizes as residual_sizes
from jax_bytegrad._src.sync.patterns import message_slices as message_slices
from jax_bytegrad._src.sync.patterns import ring_all_to_all as ring_all_to_all
from jax_bytegrad._src.sync.patterns import split_ppermute as split_ppermute

__all__ = [
    "AsyncModelAverage",
    "PipelinedMean",
    "async_model_average",
    "message_slices",
    "residual_sizes",
    "ring_all_to_all",
    "split_ppermute",
]
