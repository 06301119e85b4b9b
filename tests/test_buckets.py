"""Bucketing: whole leaves per bucket, padding, and an exact round trip."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_bytegrad as jbg
from jax_bytegrad import SyncConfig
from jax_bytegrad._src.sync import buckets, collectives, config


def leaves_of(shapes, dtypes=None):
    rng = np.random.default_rng(0)
    dtypes = dtypes or [jnp.float32] * len(shapes)
    return [jnp.asarray(rng.standard_normal(s), d) for s, d in zip(shapes, dtypes, strict=True)]


def test_buckets_hold_whole_leaves_and_close_before_overflowing():
    leaves = leaves_of([(100,), (30, 10), (50,), (400,), (7,)])
    layout = buckets.make_layout(leaves, bucket_bytes=4 * 450, granularity=64)
    # 100 + 300 + 50 fill 450 exactly; 400 would overflow, so it opens the next bucket.
    assert layout.buckets == ((0, 1, 2), (3, 4))
    assert layout.padded_sizes == (512, 448)


def test_a_leaf_larger_than_a_bucket_gets_its_own():
    leaves = leaves_of([(10,), (1000,), (10,)])
    layout = buckets.make_layout(leaves, bucket_bytes=4 * 100, granularity=8)
    assert layout.buckets == ((0,), (1,), (2,))


def test_one_bucket_when_bucket_bytes_is_none():
    leaves = leaves_of([(10,), (1000,), (10,)])
    layout = buckets.make_layout(leaves, bucket_bytes=None, granularity=8)
    assert layout.buckets == ((0, 1, 2),) and layout.padded_sizes == (1024,)


@pytest.mark.parametrize("bucket_bytes", [None, 4 * 64, 4 * 5000], ids=["one", "small", "big"])
def test_round_trip_is_exact_and_keeps_dtypes(bucket_bytes):
    shapes = [(3, 5), (0, 4), (7,), (2, 2, 2), (), (33,)]
    dtypes = [jnp.float32, jnp.float16, jnp.bfloat16, jnp.int32, jnp.float32, jnp.float32]
    leaves = leaves_of(shapes, dtypes)
    layout = buckets.make_layout(leaves, bucket_bytes=bucket_bytes, granularity=16)
    packed = buckets.to_buckets(leaves, layout)
    assert all(b.dtype == jnp.float32 and b.size % 16 == 0 for b in packed)
    # Padding is zeros, and only float elements are packed.
    assert sum(int(jnp.count_nonzero(b)) for b in packed) == 15 + 7 + 1 + 33
    out = buckets.from_buckets(packed, leaves, layout)
    for got, want in zip(out, leaves, strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_flatten_and_unflatten_like():
    tree = {"a": jnp.ones((2, 3), jnp.bfloat16), "b": jnp.arange(4.0)}
    flat = buckets.flatten_float32(tree)
    assert flat.shape == (10,) and flat.dtype == jnp.float32
    back = buckets.unflatten_like(flat * 2, tree)
    assert back["a"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(back["b"]), [0.0, 2.0, 4.0, 6.0])
    assert jax.tree.structure(back) == jax.tree.structure(tree)


def test_bucket_parts_concatenate_to_the_buckets():
    # A lone leaf of 1000 values comes as its 3 whole blocks of 256 and the rest, padded; a
    # bucket of several leaves, or of whole blocks only, comes as one part.
    leaves = leaves_of([(1000,), (10,), (6,), (2, 256)])
    layout = buckets.make_layout(leaves, bucket_bytes=4 * 500, granularity=512)
    assert layout.buckets == ((0,), (1, 2), (3,))
    parts = buckets.to_bucket_parts(leaves, layout, 256)
    assert [[p.shape[0] for p in bucket] for bucket in parts] == [[768, 256], [512], [512]]
    for bucket_parts, bucket in zip(parts, buckets.to_buckets(leaves, layout), strict=True):
        np.testing.assert_array_equal(jnp.concatenate(bucket_parts), bucket)


def test_a_bucket_takes_leaves_past_its_size_until_it_holds_min_leaves():
    leaves = leaves_of([(300,), (300,), (300,), (50,), (300,)])
    one = buckets.make_layout(leaves, bucket_bytes=4 * 400, granularity=8)
    two = buckets.make_layout(leaves, bucket_bytes=4 * 400, granularity=8, min_leaves=2)
    assert one.buckets == ((0,), (1,), (2, 3), (4,))
    # 300 + 300 passes 400, but a bucket of one leaf takes the next; 300 + 50 fits.
    assert two.buckets == ((0, 1), (2, 3), (4,))


def test_auto_is_the_platforms_grain():
    gpu = (config.GPU_BUCKET_BYTES, config.GPU_BUCKET_LEAVES)
    assert SyncConfig().bucket_grain("gpu") == gpu == (24 * 2**20, 2)
    assert SyncConfig().bucket_grain("cpu") == (config.DEFAULT_BUCKET_BYTES, 1) == (32 * 2**20, 1)
    for explicit in (2**20, config.DEFAULT_BUCKET_BYTES, None):
        assert SyncConfig(bucket_bytes=explicit).bucket_grain("gpu") == (explicit, 1)


@pytest.mark.parametrize(
    "bad",
    ["big", "AUTO", 0, -1, 1.5, True],
    ids=["string", "AUTO", "zero", "negative", "float", "bool"],
)
def test_bad_bucket_bytes_name_auto(bad):
    rule = r"bucket_bytes must be an int >= 1 or None, or 'auto' \(the platform's default\)"
    with pytest.raises(ValueError, match=rf"SyncConfig: {rule}, got {re.escape(repr(bad))}"):
        SyncConfig(bucket_bytes=bad)
    with pytest.raises(ValueError, match=rf"bytegrad: {rule}"):
        jbg.bytegrad(bucket_bytes=bad)
    with pytest.raises(ValueError, match=rf"qadam: {rule}"):
        jbg.qadam(1e-3, warmup_steps=2, bucket_bytes=bad)


def test_bucket_layout_resolves_auto_for_the_platform_it_is_given():
    # Four 20 MiB leaves: 32 MiB buckets hold one each; on GPUs, 24 MiB buckets of two.
    leaves = [jax.ShapeDtypeStruct((5 * 2**20,), jnp.float32)] * 4
    cpu = collectives.bucket_layout(leaves, SyncConfig(), (2, 4), "cpu")
    gpu = collectives.bucket_layout(leaves, SyncConfig(), (2, 4), "gpu")
    assert cpu.buckets == ((0,), (1,), (2,), (3,)) and gpu.buckets == ((0, 1), (2, 3))
    assert len(collectives.residual_sizes(leaves, SyncConfig(), (2, 4), "gpu")) == 2
    # Without a platform, the mesh being traced; outside shard_map, the default backend's.
    assert collectives.bucket_layout(leaves, SyncConfig(), (2, 4)) == (
        gpu if jax.default_backend() == "gpu" else cpu
    )
