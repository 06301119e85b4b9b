"""Worker for tests/test_wire.py: the integer all-reduce wire over Gloo, on several processes.

Run it under ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 wire_worker.py
OUT_DIR``. Each process builds its own devices' rows of the gradient, runs ``compressed_mean``
with ``wire="allreduce"`` once per case, checks that the compiled step sums uint8 codes
between nodes, and writes what each of its devices holds to ``OUT_DIR/<case>_rank<k>.npz``.

`run_case` is also imported by the test, which runs the same cases in one process on a 2 x 4
mesh of 8 CPU devices and compares.
"""

import sys
from pathlib import Path

import numpy as np

BLOCK = 256
SIZE = 8 * BLOCK * 5
# name -> compressed_mean arguments. "flat" sums over both axes in integers only, so its
# result must not depend on how the devices are spread over processes.
CASES = {
    "hier": dict(hierarchical=True),
    "flat": dict(hierarchical=False),
    "hier_sr": dict(hierarchical=True, rounding="stochastic"),
    "flat_sr_ef": dict(hierarchical=False, rounding="stochastic", feedback=True),
}


def gradient(devices: int = 8) -> np.ndarray:
    """Row d is device d's gradient (flat mesh order); a NaN in one block of device 5."""
    rng = np.random.default_rng(0)
    scales = rng.uniform(0.01, 10.0, (1, SIZE // BLOCK, 1))
    x = (rng.standard_normal((devices, SIZE // BLOCK, BLOCK)) * scales).reshape(devices, SIZE)
    x[5, 3 * BLOCK + 1] = np.nan
    return x.astype(np.float32)


def run_case(name: str, mesh, rows) -> dict[str, list[np.ndarray]]:
    """Runs one case on ``rows`` (a (devices, SIZE) array sharded over both mesh axes).

    Returns what each addressable device holds: the mean, and with feedback the residual.
    """
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jax_bytegrad import SyncConfig, compressed_mean
    from jax_bytegrad.experimental import residual_sizes
    from jax_bytegrad.profiling import communication_stats

    kwargs = dict(CASES[name])
    feedback = kwargs.pop("feedback", False)
    kwargs.update(wire="allreduce", block_size=BLOCK, bucket_bytes=None, message_bytes=None)
    n, local = mesh.shape["node"], mesh.shape["local"]
    config = SyncConfig(
        **{k: kwargs[k] for k in ("hierarchical", "block_size", "bucket_bytes", "wire")}
    )
    ((send, _),) = residual_sizes(jax.ShapeDtypeStruct((SIZE,), jnp.float32), config, (n, local))

    def body(g, key_data):
        key = None
        if kwargs.get("rounding") == "stochastic":
            key = jax.random.wrap_key_data(key_data)
        residuals = ((jnp.full((send,), 0.01, jnp.float32), jnp.zeros(0, jnp.float32)),)
        out = compressed_mean(
            g[0], key=key, residuals=residuals if feedback else None, sync=SyncConfig(**kwargs)
        )
        if feedback:
            out, ((kept, _),) = out
            return out, kept[None]
        return out, jnp.zeros((1, 1), jnp.float32)

    per_device = P(("node", "local"))
    fn = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(per_device, P()), out_specs=(P(), per_device))
    )
    key_data = jax.random.key_data(jax.random.key(7))
    stats = communication_stats(fn, rows, key_data)
    kinds = {(r.kind, r.dtype) for r in stats.rows if "node" in r.axes.split("+")}
    assert ("all-reduce", "u8") in kinds, stats
    assert not any(kind == "all-to-all" for kind, _ in kinds), stats
    mean, kept = fn(rows, key_data)
    return {
        "mean": [np.asarray(s.data) for s in mean.addressable_shards],
        "kept": [np.asarray(s.data) for s in kept.addressable_shards],
    }


def main(out_dir: Path) -> None:
    from jax_bytegrad import initialize

    info = initialize()  # before any JAX computation
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = jax.sharding.Mesh(
        np.array(devices).reshape(jax.process_count(), jax.local_device_count()),
        ("node", "local"),
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )
    local = jax.local_device_count()
    mine = gradient()[info.process_id * local : (info.process_id + 1) * local]
    rows = jax.make_array_from_process_local_data(
        NamedSharding(mesh, P(("node", "local"))), mine, (mesh.size, SIZE)
    )
    for name in CASES:
        held = run_case(name, mesh, rows)
        for copy in held["mean"][1:]:  # this process's devices agree bit for bit
            np.testing.assert_array_equal(copy.view(np.uint32), held["mean"][0].view(np.uint32))
        np.savez(
            out_dir / f"{name}_rank{info.process_id}.npz",
            mean=np.stack(held["mean"]),
            kept=np.concatenate(held["kept"]),
        )
    jax.distributed.shutdown()
    print("OK", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
