"""jax_bytegrad: data-parallel training in JAX with 8-bit compressed traffic between nodes."""

from jax_bytegrad.collectives import compressed_mean as compressed_mean
from jax_bytegrad.collectives import full_precision_mean as full_precision_mean
from jax_bytegrad.distributed import DistributedInfo as DistributedInfo
from jax_bytegrad.distributed import initialize as initialize
from jax_bytegrad.parallel import data_parallel_step as data_parallel_step
from jax_bytegrad.parallel import make_mesh as make_mesh
from jax_bytegrad.parallel import replicate as replicate
from jax_bytegrad.parallel import shard_batch as shard_batch
from jax_bytegrad.quantize import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE
from jax_bytegrad.quantize import QuantizedArray as QuantizedArray
from jax_bytegrad.quantize import dequantize as dequantize
from jax_bytegrad.quantize import quantize as quantize
from jax_bytegrad.stats import CommunicationStats as CommunicationStats
from jax_bytegrad.stats import communication_stats as communication_stats
from jax_bytegrad.transforms import ByteGradState as ByteGradState
from jax_bytegrad.transforms import bytegrad as bytegrad
from jax_bytegrad.transforms import gradient_allreduce as gradient_allreduce

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "ByteGradState",
    "CommunicationStats",
    "DistributedInfo",
    "QuantizedArray",
    "bytegrad",
    "communication_stats",
    "compressed_mean",
    "data_parallel_step",
    "dequantize",
    "full_precision_mean",
    "gradient_allreduce",
    "initialize",
    "make_mesh",
    "quantize",
    "replicate",
    "shard_batch",
]
