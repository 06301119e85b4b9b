"""Worker for tests/test_launch.py: psum over a (node, local) mesh spanning every process.

Run it under ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4``. With
``--fail-rank R`` that process raises after the first collective, while the others enter a second
collective (then a long sleep) that only the launcher can end.
"""

import argparse
import sys
import time

from jax_bytegrad import initialize

parser = argparse.ArgumentParser()
parser.add_argument("--fail-rank", type=int, default=None)
args = parser.parse_args()

info = initialize()  # must precede any JAX computation

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

n_proc, rank = jax.process_count(), jax.process_index()
n_local = jax.local_device_count()
assert (n_proc, rank) == (info.num_processes, info.process_id), (info, n_proc, rank)
print(
    f"initialized process {rank}/{n_proc} with {n_local} local devices, source={info.source}",
    flush=True,
)

devices = np.array(sorted(jax.devices(), key=lambda d: (d.process_index, d.id))).reshape(
    n_proc, n_local
)
assert all(d.process_index == p for p, row in enumerate(devices) for d in row)
mesh = jax.sharding.Mesh(devices, ("node", "local"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
sharding = NamedSharding(mesh, P("node", "local"))

# Device (p, j) holds the value 10 p + j in a (1, 1) block.
local = np.array([[10.0 * rank + j for j in range(n_local)]], dtype=np.float32)
x = jax.make_array_from_process_local_data(sharding, local, (n_proc, n_local))


@jax.jit
def sums(x):
    def body(b):
        return jax.lax.psum(b, ("node", "local")), jax.lax.psum(b, "node")

    return jax.shard_map(
        body, mesh=mesh, in_specs=P("node", "local"), out_specs=(P("node", "local"),) * 2
    )(x)


total, over_nodes = sums(x)
values = 10.0 * np.arange(n_proc)[:, None] + np.arange(n_local)[None, :]
for shard in total.addressable_shards:
    np.testing.assert_allclose(np.asarray(shard.data), np.full((1, 1), values.sum()))
for shard in over_nodes.addressable_shards:
    j = shard.index[1].start
    np.testing.assert_allclose(np.asarray(shard.data), np.full((1, 1), values[:, j].sum()))
print(f"psum over (node, local) = {float(total.addressable_shards[0].data[0, 0])}", flush=True)
print(
    f"psum over node = {[float(s.data[0, 0]) for s in over_nodes.addressable_shards]}", flush=True
)

if args.fail_rank is not None:
    if rank == args.fail_rank:
        raise RuntimeError(f"deliberate failure on rank {rank}")
    # The failed rank never joins this collective: only the launcher can end the wait.
    print("entering a collective the failed rank will never join", flush=True)
    jax.block_until_ready(sums(x + 1.0))
    time.sleep(3600)
    sys.exit(3)

jax.distributed.shutdown()
print("OK", flush=True)
