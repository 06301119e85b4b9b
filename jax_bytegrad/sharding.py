"""Placing params, batches and optimizer state on the ("node", "local") mesh that
``jax_bytegrad.make_mesh`` builds; meshes of deviceless GPUs to compile a cluster's step without
its GPUs (``gpu_mesh``)."""

from jax_bytegrad._src.gpu_mesh import GPUS as GPUS
from jax_bytegrad._src.gpu_mesh import GpuSpec as GpuSpec
from jax_bytegrad._src.gpu_mesh import gpu_mesh as gpu_mesh
from jax_bytegrad._src.mesh import AXES as AXES
from jax_bytegrad._src.mesh import replicate as replicate
from jax_bytegrad._src.mesh import shard_batch as shard_batch
from jax_bytegrad._src.mesh import shard_state as shard_state
from jax_bytegrad._src.mesh import state_specs as state_specs
from jax_bytegrad._src.steps.loop_exchange import exchange_in_loop as exchange_in_loop

__all__ = [
    "AXES",
    "GPUS",
    "GpuSpec",
    "exchange_in_loop",
    "gpu_mesh",
    "replicate",
    "shard_batch",
    "shard_state",
    "state_specs",
]
