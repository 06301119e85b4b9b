"""``process_rows``: every process's vector, for the workers' checks that the processes agree."""

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def process_rows(x: np.ndarray, mesh: Mesh) -> np.ndarray:
    """Every process's ``x``, stacked in process order, once every local device's part of the
    gather has run. ``mesh`` is the worker's ``jax_bytegrad.make_mesh()``: one node per process.

    ``multihost_utils.process_allgather`` returns as soon as its first local device's copy is
    read. With several devices per process the other devices' parts may still be connecting to
    their peers; a peer that exits meanwhile left this process in Gloo's connect at exit for
    about 150 s (1 of 12 launches of async_worker.py; 0 of 24 without the gather).
    """
    rows = jax.make_array_from_process_local_data(NamedSharding(mesh, P("node")), x[None])
    gathered = jax.jit(lambda a: a, out_shardings=NamedSharding(mesh, P()))(rows)
    gathered.block_until_ready()  # every local device's copy, not only the first
    return np.asarray(gathered.addressable_data(0))
