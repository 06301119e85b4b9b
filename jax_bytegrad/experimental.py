"""Algorithms whose interface may still change: asynchronous model averaging."""

from jax_bytegrad._src.steps.asynchronous import AsyncModelAverage as AsyncModelAverage
from jax_bytegrad._src.steps.asynchronous import async_model_average as async_model_average

__all__ = ["AsyncModelAverage", "async_model_average"]
