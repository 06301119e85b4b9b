"""jax_bytegrad: data-parallel training in JAX with 8-bit compressed traffic between nodes.

What a training script needs lives here, each name in one place: the ``Strategy``, the mesh
(``make_mesh``) and joining a multi-process run (``initialize``), the step builders, the
transforms and their states. The namespaces hold the rest: ``sharding`` (placing trees on the
mesh), ``distributed`` and ``launch`` (multi-process runs), ``checkpoint``, ``data``,
``profiling`` (bytes on the wire, memory per device), ``experimental`` (async model averaging)
and ``nnx`` (Flax NNX models; imported on first use, since it needs Flax). docs/index.md lists
each namespace's names; ``jax_bytegrad._src`` is private.
"""

import importlib

from jax_bytegrad import checkpoint as checkpoint
from jax_bytegrad import distributed as distributed
from jax_bytegrad import experimental as experimental
from jax_bytegrad import profiling as profiling
from jax_bytegrad import sharding as sharding
from jax_bytegrad._src.algorithms.bytegrad.pipelined import pipelined_step as pipelined_step
from jax_bytegrad._src.algorithms.decentralized.step import consensus_params as consensus_params
from jax_bytegrad._src.algorithms.decentralized.step import decentralized_step as decentralized_step
from jax_bytegrad._src.algorithms.decentralized.step import (
    low_precision_decentralized_step as low_precision_decentralized_step,
)
from jax_bytegrad._src.algorithms.diloco.step import diloco_step as diloco_step
from jax_bytegrad._src.algorithms.qadam.schedule import refresh_steps as refresh_steps
from jax_bytegrad._src.algorithms.qadam.transform import ScaleByQAdamState as ScaleByQAdamState
from jax_bytegrad._src.algorithms.qadam.transform import qadam as qadam
from jax_bytegrad._src.algorithms.qadam.transform import scale_by_qadam as scale_by_qadam
from jax_bytegrad._src.autotune import AutotuneResult as AutotuneResult
from jax_bytegrad._src.autotune import autotune as autotune
from jax_bytegrad._src.codecs.arrays import QuantizedArray as QuantizedArray
from jax_bytegrad._src.codecs.arrays import dequantize as dequantize
from jax_bytegrad._src.codecs.arrays import quantize as quantize
from jax_bytegrad._src.guard import DivergenceWarning as DivergenceWarning
from jax_bytegrad._src.guard import SkipNonFiniteState as SkipNonFiniteState
from jax_bytegrad._src.guard import skip_nonfinite as skip_nonfinite
from jax_bytegrad._src.guard import skipped_steps as skipped_steps
from jax_bytegrad._src.mesh import make_mesh as make_mesh
from jax_bytegrad._src.runtime.cluster import initialize as initialize
from jax_bytegrad._src.runtime.programs import LoweredPrograms as LoweredPrograms
from jax_bytegrad._src.steps.base import StepState as StepState
from jax_bytegrad._src.steps.base import TrainStep as TrainStep
from jax_bytegrad._src.steps.data_parallel import data_parallel_step as data_parallel_step
from jax_bytegrad._src.strategy import ALGORITHMS as ALGORITHMS
from jax_bytegrad._src.strategy import Strategy as Strategy
from jax_bytegrad._src.sync.collectives import compressed_mean as compressed_mean
from jax_bytegrad._src.sync.collectives import full_precision_mean as full_precision_mean
from jax_bytegrad._src.sync.config import DEFAULT_BUCKET_BYTES as DEFAULT_BUCKET_BYTES
from jax_bytegrad._src.sync.config import DEFAULT_MESSAGE_BYTES as DEFAULT_MESSAGE_BYTES
from jax_bytegrad._src.sync.config import Residuals as Residuals
from jax_bytegrad._src.sync.config import SyncConfig as SyncConfig
from jax_bytegrad._src.transforms import ByteGradState as ByteGradState
from jax_bytegrad._src.transforms import bytegrad as bytegrad
from jax_bytegrad._src.transforms import gradient_allreduce as gradient_allreduce

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MESSAGE_BYTES",
    "AutotuneResult",
    "ByteGradState",
    "DivergenceWarning",
    "LoweredPrograms",
    "QuantizedArray",
    "Residuals",
    "ScaleByQAdamState",
    "SkipNonFiniteState",
    "StepState",
    "Strategy",
    "SyncConfig",
    "TrainStep",
    "autotune",
    "bytegrad",
    "checkpoint",
    "compressed_mean",
    "consensus_params",
    "data_parallel_step",
    "decentralized_step",
    "dequantize",
    "diloco_step",
    "distributed",
    "experimental",
    "full_precision_mean",
    "gradient_allreduce",
    "initialize",
    "low_precision_decentralized_step",
    "make_mesh",
    "pipelined_step",
    "profiling",
    "qadam",
    "quantize",
    "refresh_steps",
    "scale_by_qadam",
    "sharding",
    "skip_nonfinite",
    "skipped_steps",
]


# Names the top level once exported, and where each lives now, for a script written before.
_MOVED = {
    "Checkpointer": "jax_bytegrad.checkpoint.Checkpointer",
    "CommunicationStats": "jax_bytegrad.profiling.CommunicationStats",
    "communication_stats": "jax_bytegrad.profiling.communication_stats",
    "DistributedInfo": "jax_bytegrad.distributed.DistributedInfo",
    "replicate": "jax_bytegrad.sharding.replicate",
    "shard_batch": "jax_bytegrad.sharding.shard_batch",
    "valid_kwargs": "jax_bytegrad.Strategy.valid_kwargs",
    "step_key": "step.device_key(state, device), a method of every train step",
    "DEFAULT_BLOCK_SIZES": "nowhere public: pass block_size=None for the default of bits",
    "shift_one_schedule": "nowhere public: docs/decentralized.md describes the schedule",
}


def __getattr__(name: str):
    # jax_bytegrad.nnx imports Flax, which the core does not need: load it when first used.
    if name == "nnx":
        return importlib.import_module("jax_bytegrad.nnx")
    if name in _MOVED:
        raise AttributeError(
            f"module 'jax_bytegrad' has no attribute {name!r} any more; it is now {_MOVED[name]}"
        )
    raise AttributeError(f"module 'jax_bytegrad' has no attribute {name!r}")
