"""ByteGrad's compressed mean: accuracy against exact pmean, replicas, pytrees, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jax_bytegrad

pytestmark = pytest.mark.usefixtures("strict_dtypes")

AXES = ("node", "local")
MESHES = [(2, 4), (4, 2), (8, 1), (1, 8), (3, 2)]
MESH_IDS = ["2x4", "4x2", "8x1", "1x8", "3x2"]
BLOCK = 256


def per_device_mean(mesh, tree, *, average=True, key=None, **settings):
    """Runs compressed_mean on per-device slices of ``tree`` (leading axis = device), on the
    scatter-gather wire unless told otherwise (tests/test_wire.py covers the others)."""
    sync = jax_bytegrad.SyncConfig(**{"wire": "scatter_gather", **settings})

    def body(t):
        return jax_bytegrad.compressed_mean(
            jax.tree.map(lambda x: x[0], t), sync=sync, average=average, key=key
        )

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P()))
    return fn(tree)


def block_ranges(flat, block):
    padded = np.pad(flat, (0, -flat.size % block))
    blocks = padded.reshape(-1, block)
    ranges = blocks.max(axis=1) - blocks.min(axis=1)
    return np.repeat(ranges, block)[: flat.size]


def documented_bound(per_device, n, local, hierarchical, block, bits=8):
    """Per-element bound: the first encode's errors, weighted, plus the re-encode's."""
    levels = 2 * (2**bits - 1)
    devices = n * local
    per_device = per_device.astype(np.float64)
    exact = per_device.mean(axis=0)
    if hierarchical:
        senders = per_device.reshape(n, local, -1).sum(axis=1)
        group = n
    else:
        senders, group = per_device, devices
    slop = 1e-6 * np.abs(per_device).sum(axis=0) / devices + 1e-30
    if group == 1:
        return exact, slop
    first = sum(block_ranges(s, block) for s in senders) / (levels * devices)
    second = (block_ranges(exact, block) + 2 * first) / levels
    return exact, first + second + slop


def flat_f32(tree):
    """Per-device leaves as rows, concatenated in bucket order (tree order)."""
    leaves = jax.tree.leaves(tree)
    return np.concatenate([np.asarray(x, np.float32).reshape(x.shape[0], -1) for x in leaves], 1)


def flat_result(tree):
    """A replicated result, concatenated in the same bucket order as ``flat_f32``."""
    return np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in jax.tree.leaves(tree)])


@pytest.mark.parametrize("bits", [8, 4], ids=["8bit", "4bit"])
@pytest.mark.parametrize("hierarchical", [True, False], ids=["hier", "flat"])
@pytest.mark.parametrize("shape", MESHES, ids=MESH_IDS)
def test_within_quantization_bound_of_exact_mean(shape, hierarchical, bits):
    n, local = shape
    devices = n * local
    mesh = jax_bytegrad.make_mesh(n, local)
    rng = np.random.default_rng(n * 10 + local)
    grads = [
        jnp.asarray(rng.standard_normal((devices, 3000)) * 0.1, jnp.float32),
        jnp.asarray(rng.standard_normal((devices, 40, 25)) * 10.0, jnp.float32),
    ]
    out = per_device_mean(
        mesh, grads, hierarchical=hierarchical, bits=bits, block_size=BLOCK, bucket_bytes=None
    )
    result = flat_result(out)
    exact, bound = documented_bound(flat_f32(grads), n, local, hierarchical, BLOCK, bits)
    err = np.abs(result - exact)
    assert np.all(err <= bound), f"worst excess {np.max(err - bound)}"
    if hierarchical and n == 1:
        # No inter-node hop: float32 pmean, up to float rounding.
        np.testing.assert_allclose(result, exact, rtol=1e-5, atol=1e-6)
    else:
        assert np.max(err) > 0  # it really was quantized


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)], ids=["2x4", "1x8"])
def test_average_false_sums(shape):
    mesh = jax_bytegrad.make_mesh(*shape)
    devices = shape[0] * shape[1]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((devices, 1000)), jnp.float32)
    mean = per_device_mean(mesh, x, block_size=BLOCK)
    total = per_device_mean(mesh, x, block_size=BLOCK, average=False)
    exact = np.asarray(x, np.float64).sum(axis=0)
    spread = exact.max() - exact.min()
    assert np.max(np.abs(np.asarray(total) - exact)) < 4 * spread / 510
    np.testing.assert_allclose(np.asarray(total) / devices, np.asarray(mean), atol=spread / 200)


def test_awkward_pytree_leaves():
    mesh = jax_bytegrad.make_mesh(2, 4)
    rng = np.random.default_rng(2)
    tree = {
        "one": jnp.asarray(rng.standard_normal((8, 1)), jnp.float32),
        "seven": jnp.asarray(rng.standard_normal((8, 7)), jnp.bfloat16),
        "big": jnp.asarray(rng.standard_normal((8, 1_000_003)), jnp.float32),
        "empty": jnp.zeros((8, 0, 3), jnp.float16),
        "half": jnp.asarray(rng.standard_normal((8, 5, 3)), jnp.float16),
    }

    def body(t):
        t = jax.tree.map(lambda x: x[0], t)
        return jax_bytegrad.compressed_mean(
            t, sync=jax_bytegrad.SyncConfig(block_size=BLOCK, bucket_bytes=1 << 20)
        )

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P()))
    out = fn(tree)
    for name, leaf in tree.items():
        got = out[name]
        assert got.shape == leaf.shape[1:] and got.dtype == leaf.dtype, name
        if leaf.size:
            exact = np.asarray(leaf, np.float64).mean(axis=0)
            spread = np.ptp(np.asarray(leaf, np.float64)) + 1e-3
            np.testing.assert_allclose(np.asarray(got, np.float64), exact, atol=spread / 50)


@pytest.mark.parametrize("mean", ["compressed", "full_precision"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.uint8], ids=str)
def test_an_integer_leaf_is_refused_by_name(mean, dtype):
    # Passing it through would hand every device its own value back as if it were the mean.
    mesh = jax_bytegrad.make_mesh(2, 4)
    average = {
        "compressed": jax_bytegrad.compressed_mean,
        "full_precision": jax_bytegrad.full_precision_mean,
    }[mean]
    tree = {"w": jnp.ones((8, 4), jnp.float32), "counts": jnp.ones((8, 3), dtype)}

    def body(t):
        return average(jax.tree.map(lambda x: x[0], t))

    fn = jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P())
    with pytest.raises(ValueError, match=r"leaf \['counts'\] has dtype .*float32, bfloat16"):
        jax.jit(fn)(tree)


def test_bytegrad_refuses_an_integer_gradient_leaf_in_a_train_step():
    mesh = jax_bytegrad.make_mesh(2, 4)
    tx = optax.chain(jax_bytegrad.bytegrad(), optax.sgd(0.1))
    step = jax_bytegrad.data_parallel_step(lambda p, b: jnp.mean(b @ p["w"]), tx, mesh)
    state = step.init({"w": jnp.ones(3)})
    # A user loop that feeds integer "gradients" straight to the transform, as the issue saw.
    grads = {"w": jnp.arange(3, dtype=jnp.int32)}
    fn = jax.shard_map(
        lambda g, s: tx.update(g, s)[0], mesh=mesh, in_specs=(P(), P()), out_specs=P()
    )
    with pytest.raises(ValueError, match=r"leaf \['w'\] has dtype int32"):
        jax.jit(fn)(grads, state.opt_state)


def test_float0_gradients_of_integer_params_pass_through():
    mesh = jax_bytegrad.make_mesh(2, 4)

    def body(w, step_count):
        loss = lambda p: jnp.sum(p["w"] ** 2)  # the int "count" gets a float0 gradient
        grads = jax.grad(loss, allow_int=True)({"w": w, "count": step_count})
        grads["w"] = jax.lax.pcast(grads["w"], AXES, to="varying")
        out = jax_bytegrad.compressed_mean(grads)
        seen.append(out["count"].dtype)
        return out["w"]

    seen = []
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P()))
    np.testing.assert_allclose(np.asarray(fn(jnp.ones(256), jnp.int32(3))), 2.0, rtol=1e-2)
    assert seen == [jax.dtypes.float0]


def test_stochastic_rounding_runs_and_stays_close():
    mesh = jax_bytegrad.make_mesh(2, 4)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((8, 4096)), jnp.float32)
    a = per_device_mean(mesh, x, block_size=BLOCK, rounding="stochastic", key=jax.random.key(0))
    b = per_device_mean(mesh, x, block_size=BLOCK, rounding="stochastic", key=jax.random.key(1))
    exact = np.asarray(x, np.float64).mean(axis=0)
    assert np.max(np.abs(np.asarray(a) - exact)) < 0.1
    assert not np.array_equal(np.asarray(a), np.asarray(b))


def test_full_precision_mean_hierarchical_and_flat_agree():
    mesh = jax_bytegrad.make_mesh(2, 4)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((8, 1001)), jnp.float32)
    outs = []
    for hierarchical in (True, False):

        def body(t, hierarchical=hierarchical):
            return jax_bytegrad.full_precision_mean(
                t[0], sync=jax_bytegrad.SyncConfig(hierarchical=hierarchical)
            )

        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXES), out_specs=P()))
        outs.append(np.asarray(fn(x)))
    exact = np.asarray(x, np.float64).mean(axis=0)
    for out in outs:
        np.testing.assert_allclose(out, exact, rtol=1e-5, atol=1e-6)


def test_outside_shard_map_raises_clear_error():
    tx = jax_bytegrad.bytegrad()
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="must run inside jax.shard_map"):
        tx.update(params, tx.init(params))


def test_missing_axis_name_raises_clear_error():
    mesh = jax_bytegrad.make_mesh(2, 4)
    tx = jax_bytegrad.bytegrad(node_axis="hosts")

    def body(g):
        return tx.update(g, tx.init(g))[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P())
    with pytest.raises(ValueError, match=r"axis 'hosts' is not in the mesh axes .*node_axis="):
        jax.jit(fn)(jnp.ones(3))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(block_size=100), "block_size must be a power of two"),
        (dict(bits=3), "bits must be one of 8, 4, 2, got 3"),
        (dict(bits=2, block_size=256), "power of two >= 512, got 256"),
        (dict(bits=2, wire="allreduce"), "2-bit codes sum over at most 1 device"),
        (dict(bits=4, block_size=128), "power of two >= 256, got 128"),
        (dict(error_feedback=True), "error_feedback=True keeps residuals per device"),
        (dict(error_feedback=1, mesh=None), "error_feedback must be True or False"),
        (dict(rounding="floor"), "rounding must be"),
        (dict(bucket_bytes=0), "bucket_bytes must be an int >= 1 or None, or 'auto'.*got 0"),
        (dict(hierarchical="yes"), "hierarchical must be True or False"),
        (dict(node_axis="x", local_axis="x"), "must differ"),
        (dict(implementation="cuda"), "implementation must be"),
    ],
    ids=[
        "block",
        "bits",
        "2bit256",
        "2bit_allreduce",
        "4bit128",
        "nomesh",
        "ef",
        "rounding",
        "bucket",
        "flag",
        "axes",
        "impl",
    ],
)
def test_bytegrad_validates_at_build_time(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jax_bytegrad.bytegrad(**kwargs)


def test_init_accepts_shape_dtype_structs():
    params = {"w": jax.ShapeDtypeStruct((3, 4), jnp.float32)}
    for tx in (
        optax.chain(jax_bytegrad.bytegrad(), optax.adam(1e-3)),
        optax.chain(jax_bytegrad.gradient_allreduce(), optax.adam(1e-3)),
    ):
        state = jax.eval_shape(tx.init, params)
        assert jax.tree.leaves(state)
        state = tx.init(params)  # the state's shapes need no concrete values
        assert any(getattr(leaf, "shape", None) == (3, 4) for leaf in jax.tree.leaves(state))


def test_compressed_mean_refuses_a_sync_that_is_not_a_sync_config():
    mesh = jax_bytegrad.make_mesh(1, 1)
    f = jax.shard_map(
        lambda t: jax_bytegrad.compressed_mean(t, sync={"bits": 4}),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match="sync must be a jax_bytegrad.SyncConfig, got dict"):
        f({"w": jnp.ones(3)})


def test_sync_config_codec_is_the_part_the_quantizers_read():
    codec = jax_bytegrad.SyncConfig(bits=4, rounding="stochastic", implementation="xla").codec
    assert (codec.stochastic, codec.bits, codec.implementation) == (True, 4, "xla")
    with pytest.raises(AttributeError):
        codec.bits = 8  # frozen: it travels inside a hashable config
