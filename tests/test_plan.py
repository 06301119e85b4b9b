"""The sync resolved once where it starts (``config.plan_sync``): one frozen ``BucketPlan`` per
bucket, which the wires take, and ``sync_mean``'s one return type."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad import SyncConfig
from jax_bytegrad._src.codecs import Codec, integer
from jax_bytegrad._src.sync.collectives import sync_mean
from jax_bytegrad._src.sync.config import Residuals, plan_sync
from jax_bytegrad.experimental import residual_sizes

AXES = ("node", "local")
BLOCK = 256

_TWO_BUCKETS = [
    jax.ShapeDtypeStruct((3000,), jnp.float32),
    jax.ShapeDtypeStruct((5000,), jnp.bfloat16),
]


@pytest.mark.parametrize(
    ("settings", "shape", "wire", "width", "residuals"),
    [
        ({}, (2, 4), "allreduce", integer.Width(8, 127), ((1024, 0), (1536, 0))),
        ({"bits": 4}, (2, 4), "scatter_gather", None, ((1024, 512), (1536, 768))),
        (
            {"hierarchical": False},
            (2, 4),
            "allreduce",
            integer.Width(8, 31),
            ((4096, 0), (6144, 0)),
        ),
        (
            {"hierarchical": False, "bits": 4},
            (2, 4),
            "scatter_gather",
            None,
            ((4096, 512), (6144, 768)),
        ),
        ({}, (1, 4), "allreduce", None, ((0, 0), (0, 0))),
    ],
    ids=["integer", "4-bit", "flat", "flat-4-bit", "one-node"],
)
def test_the_sync_resolves_once_into_one_frozen_plan_per_bucket(
    settings, shape, wire, width, residuals
):
    config = SyncConfig(bucket_bytes=12000, block_size=BLOCK, **settings)
    plan = plan_sync(config, _TWO_BUCKETS, shape, "cpu", weight=0.125)
    grain = shape[0] * shape[1] * BLOCK  # each bucket: whole blocks on every device
    padded = tuple(-(-n // grain) * grain for n in (3000, 5000))
    assert plan.layout.buckets == ((0,), (1,)) and plan.layout.padded_sizes == padded
    assert plan.residual_sizes == residuals == residual_sizes(_TWO_BUCKETS, config, shape, "cpu")
    first, second = plan.buckets
    assert (first.index, first.dtype, second.index, second.dtype) == (
        0, jnp.float32, 1, jnp.bfloat16,
    )  # fmt: skip
    for bucket in plan.buckets:
        assert bucket.group == config.group(*shape) and bucket.group.wire == wire
        assert (bucket.width, bucket.codec, bucket.weight) == (width, config.codec, 0.125)
    hash(plan)  # frozen, so a step may key a cache on it
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.weight = 1.0


def test_sync_mean_returns_the_mean_and_the_residuals_whatever_its_input():
    mesh = jax_bytegrad.make_mesh(2, 4)
    tree = {"w": jax.ShapeDtypeStruct((8, 3000), jnp.float32)}
    for config, residuals in [
        (SyncConfig(), None),
        (SyncConfig(error_feedback=True), residual_sizes(_TWO_BUCKETS[0], SyncConfig(), (2, 4))),
    ]:
        given = None
        if residuals is not None:
            given = Residuals(tuple(jnp.zeros(8 * n) for n in pair) for pair in residuals)

        def body(g, r, config=config):
            return sync_mean(jax.tree.map(lambda a: a[0], g), config, residuals=r)

        fn = jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P(), check_vma=False)
        mean, kept = jax.eval_shape(fn, tree, given)
        assert mean["w"].shape == (3000,) and isinstance(kept, Residuals)
        assert len(kept) == (0 if residuals is None else 1)


def test_the_configs_derived_values_are_resolved_once_and_are_not_settings():
    config = SyncConfig(bits=4, rounding="stochastic", implementation="xla")
    assert config.axes == AXES and config.stochastic
    assert config.codec == Codec(bits=4, stochastic=True, implementation="xla")
    # Derived again with the settings they come from, and never settings of their own: a
    # config's fields rebuild an equal config.
    changed = config.replace(rounding="nearest", node_axis="hosts")
    assert not changed.stochastic and not changed.codec.stochastic
    assert changed.axes == ("hosts", "local")
    assert SyncConfig(**dataclasses.asdict(config)) == config
    assert "codec" not in repr(config) and "axes" not in dataclasses.asdict(config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.stochastic = False
