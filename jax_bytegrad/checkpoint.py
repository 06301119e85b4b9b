"""Checkpoints of a train state through orbax, restored exactly, also onto another mesh."""

from jax_bytegrad._src.checkpoint import Checkpointer as Checkpointer
from jax_bytegrad._src.checkpoint import average_replicas as average_replicas
from jax_bytegrad._src.checkpoint import replicated_shardings as replicated_shardings

__all__ = ["Checkpointer", "average_replicas", "replicated_shardings"]
