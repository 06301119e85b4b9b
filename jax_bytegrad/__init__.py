"""jax_bytegrad: data-parallel training in JAX with 8-bit compressed traffic between nodes."""

from jax_bytegrad.async_averaging import AsyncModelAverage as AsyncModelAverage
from jax_bytegrad.async_averaging import async_model_average as async_model_average
from jax_bytegrad.autotuning import AutotuneResult as AutotuneResult
from jax_bytegrad.autotuning import autotune as autotune
from jax_bytegrad.checkpoint import Checkpointer as Checkpointer
from jax_bytegrad.collectives import compressed_mean as compressed_mean
from jax_bytegrad.collectives import full_precision_mean as full_precision_mean
from jax_bytegrad.decentralized import DecentralizedState as DecentralizedState
from jax_bytegrad.decentralized import DecentralizedTrainStep as DecentralizedTrainStep
from jax_bytegrad.decentralized import (
    LowPrecisionDecentralizedState as LowPrecisionDecentralizedState,
)
from jax_bytegrad.decentralized import consensus_params as consensus_params
from jax_bytegrad.decentralized import decentralized_step as decentralized_step
from jax_bytegrad.decentralized import (
    low_precision_decentralized_step as low_precision_decentralized_step,
)
from jax_bytegrad.decentralized import shift_one_schedule as shift_one_schedule
from jax_bytegrad.distributed import DistributedInfo as DistributedInfo
from jax_bytegrad.distributed import initialize as initialize
from jax_bytegrad.parallel import data_parallel_step as data_parallel_step
from jax_bytegrad.parallel import make_mesh as make_mesh
from jax_bytegrad.parallel import replicate as replicate
from jax_bytegrad.parallel import shard_batch as shard_batch
from jax_bytegrad.qadam_optimizer import ScaleByQAdamState as ScaleByQAdamState
from jax_bytegrad.qadam_optimizer import qadam as qadam
from jax_bytegrad.qadam_optimizer import scale_by_qadam as scale_by_qadam
from jax_bytegrad.quantization import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from jax_bytegrad.quantization import QuantizedArray as QuantizedArray
from jax_bytegrad.quantization import dequantize as dequantize
from jax_bytegrad.quantization import quantize as quantize
from jax_bytegrad.stats import CommunicationStats as CommunicationStats
from jax_bytegrad.stats import communication_stats as communication_stats
from jax_bytegrad.strategy import ALGORITHMS as ALGORITHMS
from jax_bytegrad.strategy import Strategy as Strategy
from jax_bytegrad.strategy import TrainState as TrainState
from jax_bytegrad.strategy import TrainStep as TrainStep
from jax_bytegrad.strategy import valid_kwargs as valid_kwargs
from jax_bytegrad.transforms import ByteGradState as ByteGradState
from jax_bytegrad.transforms import bytegrad as bytegrad
from jax_bytegrad.transforms import gradient_allreduce as gradient_allreduce

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "async_model_average",
    "autotune",
    "AutotuneResult",
    "AsyncModelAverage",
    "bytegrad",
    "ByteGradState",
    "communication_stats",
    "CommunicationStats",
    "compressed_mean",
    "consensus_params",
    "data_parallel_step",
    "decentralized_step",
    "DecentralizedState",
    "DecentralizedTrainStep",
    "DEFAULT_BLOCK_SIZE",
    "dequantize",
    "DistributedInfo",
    "full_precision_mean",
    "gradient_allreduce",
    "initialize",
    "low_precision_decentralized_step",
    "LowPrecisionDecentralizedState",
    "make_mesh",
    "qadam",
    "quantize",
    "QuantizedArray",
    "replicate",
    "scale_by_qadam",
    "ScaleByQAdamState",
    "shard_batch",
    "shift_one_schedule",
    "Strategy",
    "TrainState",
    "TrainStep",
    "valid_kwargs",
    "Checkpointer",
]
