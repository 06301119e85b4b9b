"""bfloat16 gradients: the dtype each collective runs in, and the means it gives.

A bfloat16 user's own all-reduce sends bfloat16: ``gradient_allreduce`` sums each gradient in
its own dtype unless ``reduce_dtype`` says otherwise, and ByteGrad sums and gathers a bucket of
bfloat16 leaves in bfloat16 within the node (benchmarks/RESULTS.md, "bfloat16").

XLA:CPU runs bfloat16 collectives in float32 (not float16 ones), so the compiled CPU program
shows float32 where JAX asked for bfloat16: the tests read the dtypes JAX asks for from the
lowered program, the ones XLA:GPU runs from steps compiled for deviceless H100s (with JAX's
CUDA plugin, Python 3.12), and float16's from the compiled CPU program.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import needs_gpu_plugin
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad import compressed_mean, full_precision_mean
from jax_bytegrad._src.sync import buckets
from jax_bytegrad.profiling import communication_stats
from jax_bytegrad.sharding import gpu_mesh

AXES = ("node", "local")
BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)
# StableHLO's and HLO's names of the dtypes.
NAMES = {BF16: "bf16", F16: "f16", F32: "f32"}


needs_plugin = needs_gpu_plugin("the lowered-program tests check the same dtypes on CPU")


def params_of(dtype, f32_bias: bool = False):
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(256, 128)) * 0.1,
        "b1": np.zeros(128),
        "w2": rng.normal(size=(128, 16)) * 0.1,
    }
    params = {k: jnp.asarray(v, dtype) for k, v in params.items()}
    params["b2"] = jnp.zeros(16, F32 if f32_bias else dtype)
    params["scale"] = jnp.ones((), dtype)  # a leaf the node's devices cannot split
    return params


def loss_fn(params, batch):
    x, y = batch
    h = jnp.tanh(x.astype(params["w1"].dtype) @ params["w1"] + params["b1"][None]) * params["scale"]
    out = (h @ params["w2"]).astype(jnp.float32) + params["b2"].astype(jnp.float32)[None]
    return jnp.mean((out - y) ** 2)


def batch_of(rows: int = 64):
    rng = np.random.default_rng(1)
    return (
        rng.normal(size=(rows, 256)).astype(np.float32),
        rng.normal(size=(rows, 16)).astype(np.float32),
    )


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _step(mesh, algorithm: str, **kwargs):
    return jax_bytegrad.Strategy(algorithm, mesh=mesh, **kwargs).train_step(loss_fn, optax.sgd(0.1))


# A StableHLO collective and its result type, e.g. tensor<2048xbf16> (dims "2048", "bf16").
COLLECTIVE = (
    r'"stablehlo\.(all_reduce|reduce_scatter|all_gather)".*?'
    r"\) -> tensor<([0-9x]*?)x?([a-z]+[0-9]+)>"
)


def lowered_collectives(step, params, batch) -> list[tuple[str, str, tuple[int, ...]]]:
    """(kind, dtype, shape) of every collective in the program JAX hands XLA."""
    text = step.lower(step.state_shapes(params), abstract(batch)).as_text()
    found = re.findall(COLLECTIVE, text, flags=re.S)
    assert found, "no collectives in the lowered step"
    return [
        (kind, dtype, tuple(int(d) for d in dims.split("x") if d)) for kind, dims, dtype in found
    ]


def gradient_collectives(found):
    """The collectives that move gradients: all but the loss's scalar mean."""
    return [(kind, dtype) for kind, dtype, shape in found if shape]


def compiled_rows(step, params, batch):
    stats = step.communication_stats(step.state_shapes(params), abstract(batch))["step"]
    return stats


# XLA:CPU's promotion, which the docs report -----------------------------------------------------


@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_gather"])
def test_xla_cpu_runs_bfloat16_collectives_in_float32_but_not_float16(op):
    mesh = jax_bytegrad.make_mesh(2, 4)
    fn = {
        "psum": lambda x: jax.lax.psum(x, "local"),
        "psum_scatter": lambda x: jax.lax.psum_scatter(x, "local", tiled=True),
        "all_gather": lambda x: jax.lax.all_gather(x, "local", tiled=True),
    }[op]
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))
    for dtype, compiled in ((BF16, "f32"), (F16, "f16"), (F32, "f32")):
        x = jax.device_put(jnp.ones(8 * 64, dtype), jax.NamedSharding(mesh, P(AXES)))
        lowered = f.lower(x).as_text()
        assert re.search(rf"tensor<\d+x{NAMES[dtype]}>", lowered), (op, dtype)
        (row,) = communication_stats(f, x).rows
        assert row.dtype == compiled, (op, dtype, row)
        size, value = {"psum": (512, 4), "psum_scatter": (128, 4), "all_gather": (2048, 1)}[op]
        np.testing.assert_array_equal(np.asarray(f(x), np.float32), np.full(size, value))


# gradient_allreduce ---------------------------------------------------------------------------


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
@pytest.mark.parametrize(
    "reduce_dtype", [None, jnp.float32, "bfloat16"], ids=["own", "f32", "bf16"]
)
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16_params", "f32_params"])
def test_gradient_allreduce_sums_in_the_gradients_dtype_unless_told(
    dtype, reduce_dtype, hierarchical
):
    mesh = jax_bytegrad.make_mesh(2, 4)
    with _step(
        mesh, "gradient_allreduce", hierarchical=hierarchical, reduce_dtype=reduce_dtype
    ) as step:
        found = gradient_collectives(lowered_collectives(step, params_of(dtype), batch_of()))
    want = NAMES[dtype if reduce_dtype is None else jnp.dtype(reduce_dtype)]
    kinds = {"all_reduce"} if not hierarchical else {"reduce_scatter", "all_reduce", "all_gather"}
    assert {kind for kind, _ in found} == kinds
    assert {d for _, d in found} == {want}, found


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
def test_float16_gradients_cross_as_float16_in_the_compiled_cpu_step(hierarchical):
    # XLA:CPU keeps float16 collectives as they are: the compiled step is the proof.
    mesh = jax_bytegrad.make_mesh(2, 4)
    size = sum(int(np.size(x)) for x in jax.tree.leaves(params_of(F16)))
    got = {}
    for reduce_dtype in (None, jnp.float32):
        with _step(
            mesh, "gradient_allreduce", hierarchical=hierarchical, reduce_dtype=reduce_dtype
        ) as step:
            stats = compiled_rows(step, params_of(F16), batch_of())
        rows = [r for r in stats.rows if r.payload_bytes > 4]  # not the loss's mean
        assert {r.dtype for r in rows} == {"f16" if reduce_dtype is None else "f32"}
        got[reduce_dtype] = stats.bytes_on("node")
        if not hierarchical:
            (row,) = rows
            # XLA may combine the loss's float32 mean into the float32 one: 4 bytes more.
            assert row.payload_bytes - size * (2 if reduce_dtype is None else 4) in (0, 4)
    assert got[None] == pytest.approx(got[jnp.float32] / 2, rel=0.01)


def _per_device_mean(fn, tree):
    mesh = jax_bytegrad.make_mesh(2, 4)
    f = jax.jit(jax.shard_map(lambda t: fn(jax.tree.map(lambda x: x[0], t)), mesh=mesh,
                              in_specs=P(AXES), out_specs=P()))  # fmt: skip
    return f(tree)


def _tree(rng, dtype):
    return {
        "w": jnp.asarray(rng.normal(size=(8, 40, 3)), dtype),
        "v": jnp.asarray(rng.normal(size=(8, 7)), dtype),
    }


@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
def test_the_means_are_right_in_either_dtype(hierarchical):
    rng = np.random.default_rng(3)
    tree = {**_tree(rng, BF16), "exact": jnp.asarray(rng.normal(size=(8, 5)), F32)}
    exact = jax.tree.map(lambda x: np.asarray(x, np.float64).mean(axis=0), tree)
    means = {}
    for reduce_dtype in (None, jnp.float32):
        mean = functools.partial(
            full_precision_mean,
            sync=jax_bytegrad.SyncConfig(hierarchical=hierarchical),
            reduce_dtype=reduce_dtype,
        )
        means[reduce_dtype] = out = _per_device_mean(mean, tree)
        for name, leaf in out.items():
            assert leaf.dtype == tree[name].dtype and leaf.shape == tree[name].shape[1:]
            # bfloat16: 8 significant bits, a few roundings.
            atol = 1e-6 if leaf.dtype == F32 else 2e-2
            np.testing.assert_allclose(np.asarray(leaf, np.float64), exact[name], atol=atol)
    # The float32 leaf is summed as float32 either way.
    np.testing.assert_array_equal(means[None]["exact"], means[jnp.float32]["exact"])


def test_reduce_dtype_bfloat16_sums_float32_gradients_in_bfloat16():
    rng = np.random.default_rng(4)
    tree = {"w": jnp.asarray(rng.normal(size=(8, 300)), F32)}
    exact = np.asarray(tree["w"], np.float64).mean(axis=0)
    wide = _per_device_mean(full_precision_mean, tree)["w"]
    narrow = _per_device_mean(functools.partial(full_precision_mean, reduce_dtype=BF16), tree)
    narrow = narrow["w"]
    assert narrow.dtype == F32
    np.testing.assert_allclose(np.asarray(wide), exact, atol=1e-6)
    # Each value went through bfloat16: within its rounding, and no longer exact.
    np.testing.assert_allclose(np.asarray(narrow), exact, rtol=2e-2, atol=2e-2)
    assert np.abs(np.asarray(narrow) - exact).max() > 1e-4
    assert np.array_equal(np.asarray(narrow), np.asarray(narrow.astype(BF16).astype(F32)))


def test_float0_leaves_pass_with_reduce_dtype():
    seen = []

    def mean(tree):
        tree = {**tree, "n": np.zeros(3, jax.dtypes.float0)}  # jax.grad of an integer leaf
        out = full_precision_mean(tree, reduce_dtype=F32)
        seen.append(out["n"].dtype)
        return out["w"]

    out = _per_device_mean(mean, {"w": jnp.ones((8, 4), BF16)})
    assert seen == [jax.dtypes.float0] and out.dtype == BF16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.ones(4))


@pytest.mark.parametrize("bad", ["int8", jnp.int32, "banana", object(), jnp.bool_])
def test_a_bad_reduce_dtype_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"gradient_allreduce: reduce_dtype must be None"):
        jax_bytegrad.gradient_allreduce(reduce_dtype=bad)
    with pytest.raises(ValueError, match=r"gradient_allreduce: reduce_dtype must be None"):
        jax_bytegrad.Strategy(
            "gradient_allreduce", mesh=jax_bytegrad.make_mesh(2, 4), reduce_dtype=bad
        )
    with pytest.raises(ValueError, match=r"full_precision_mean: reduce_dtype must be None"):
        _per_device_mean(
            functools.partial(full_precision_mean, reduce_dtype=bad),
            _tree(np.random.default_rng(0), F32),
        )


def test_the_strategy_takes_reduce_dtype_from_the_transform():
    assert "reduce_dtype" in jax_bytegrad.Strategy.valid_kwargs("gradient_allreduce")
    s = jax_bytegrad.Strategy("gradient_allreduce", mesh=jax_bytegrad.make_mesh(2, 4))
    assert s.setting("reduce_dtype") is None
    for good in (jnp.float32, "float32", np.dtype("float32"), F16):
        jax_bytegrad.gradient_allreduce(reduce_dtype=good)


# ByteGrad within the node --------------------------------------------------------------------


def test_a_bucket_is_bfloat16_only_when_all_its_leaves_are():
    def dtype_of(*dtypes):
        leaves = [jax.ShapeDtypeStruct((10,), d) for d in dtypes]
        layout = buckets.make_layout(leaves, bucket_bytes=None, granularity=8)
        return layout.bucket_dtypes[0]

    assert dtype_of(BF16, BF16) == BF16
    assert dtype_of(BF16, F32) == F32
    assert dtype_of(BF16, F16) == F32
    assert dtype_of(F16) == F32  # a node's float16 sum can overflow where its mean would not
    assert dtype_of(F32) == F32


WITHIN = [
    pytest.param(BF16, False, None, "bf16", id="bf16"),
    pytest.param(BF16, True, None, "f32", id="bf16_with_f32_bias_one_bucket"),
    pytest.param(F16, False, None, "f32", id="f16"),
    pytest.param(F32, False, None, "f32", id="f32"),
    pytest.param(BF16, False, "optimizer", "bf16", id="bf16_shard_optimizer"),
    # shard="params": XLA's partitioner makes the collectives within the node, at compile
    # time (test_on_gpus_params_sharded_bfloat16_moves_bfloat16_within_the_node).
]


@pytest.mark.parametrize(("dtype", "f32_bias", "shard", "want"), WITHIN)
def test_bytegrad_sums_and_gathers_within_the_node_in_the_buckets_dtype(
    dtype, f32_bias, shard, want
):
    mesh = jax_bytegrad.make_mesh(2, 4)
    params = params_of(dtype, f32_bias)
    with _step(mesh, "bytegrad", bucket_bytes=None, shard=shard) as step:
        found = lowered_collectives(step, params, batch_of())
    # The bucket's reduce-scatter over "local" (the largest one) and its all-gather there.
    scatter = max((s for k, _, s in found if k == "reduce_scatter"), key=np.prod)
    assert [d for k, d, s in found if k == "reduce_scatter" and s == scatter] == [want]
    codes = [d for k, d, s in found if k == "all_reduce" and d.startswith("ui")]
    assert codes == ["ui8"]  # the codes between nodes, whatever the gradient's dtype
    # The bucket's gather (with shard=..., of the leaves split whole, and the params' own).
    gathers = [d for k, d, _ in found if k == "all_gather"]
    assert set(gathers) == {want} and (shard is not None or len(gathers) == 1)


def test_float16_buckets_are_summed_in_float32_in_the_compiled_cpu_step():
    mesh = jax_bytegrad.make_mesh(2, 4)
    with _step(mesh, "bytegrad", bucket_bytes=None) as step:
        stats = compiled_rows(step, params_of(F16), batch_of())
    local = {(r.kind, r.dtype) for r in stats.rows if r.axes == "local"}
    assert local == {("reduce-scatter", "f32"), ("all-gather", "f32")}


def _bytegrad_mean(tree, **kwargs):
    return _per_device_mean(functools.partial(compressed_mean, **kwargs), tree)


@pytest.mark.parametrize("wire", ["allreduce", "scatter_gather"])
def test_bytegrad_means_of_bfloat16_gradients_are_right(wire):
    rng = np.random.default_rng(5)
    tree = _tree(rng, BF16)
    sync = jax_bytegrad.SyncConfig(wire=wire, block_size=128)
    out = _bytegrad_mean(tree, sync=sync)
    wide = _bytegrad_mean(jax.tree.map(lambda x: x.astype(F32), tree), sync=sync)
    for name, leaf in tree.items():
        values = np.asarray(leaf, np.float64)
        exact = values.mean(axis=0)
        got = np.asarray(out[name], np.float64)
        assert out[name].dtype == BF16 and got.shape == exact.shape
        # Within a code step (the node sums' range / 127 per node, 2 nodes) and bfloat16's
        # rounding of the result, as float32 within the node is.
        step = 2 * 4 * np.ptp(values) / 127 / 8
        np.testing.assert_allclose(got, exact, atol=step + 1e-2 * np.abs(exact).max())
        np.testing.assert_allclose(got, np.asarray(wide[name], np.float64), atol=2 * step)


def test_the_pipelined_step_trains_bfloat16_as_the_one_program_step():
    # The pipelined step keeps float32 buckets (it runs on CPUs, where XLA moves bfloat16
    # collectives as float32 anyway); both train the same model to nearly the same point.
    mesh = jax_bytegrad.make_mesh(2, 4)
    params = params_of(BF16)
    finals = []
    for pipeline in (False, True):
        with jax_bytegrad.Strategy("bytegrad", mesh=mesh, pipeline=pipeline).train_step(
            loss_fn, optax.sgd(0.05)
        ) as step:
            state = step.init(params)
            for _ in range(3):
                state, metrics = step(state, batch_of())
            finals.append(jax.device_get(step.params(state)))
    for name in params:
        assert finals[0][name].dtype == finals[1][name].dtype == BF16
        a, b = (np.asarray(f[name], np.float64) for f in finals)
        np.testing.assert_allclose(a, b, atol=1e-2)
        assert not np.array_equal(a, np.asarray(params[name], np.float64))


# What XLA:GPU runs, compiled for deviceless H100s ----------------------------------------------


@needs_plugin
@pytest.mark.parametrize("hierarchical", [False, True], ids=["flat", "hierarchical"])
def test_on_gpus_gradient_allreduce_sends_bfloat16_by_default(hierarchical):
    mesh = gpu_mesh(2, 4)
    params = abstract(params_of(BF16))
    stats = {}
    for reduce_dtype in (None, jnp.float32):
        step = _step(
            mesh, "gradient_allreduce", hierarchical=hierarchical, reduce_dtype=reduce_dtype
        )
        stats[reduce_dtype] = s = compiled_rows(step, params, batch_of())
        rows = [r for r in s.rows if r.payload_bytes > 4]
        assert {r.dtype for r in rows} == {"bf16" if reduce_dtype is None else "f32"}, rows
    for axis in AXES:
        assert stats[None].bytes_on(axis) == pytest.approx(
            stats[jnp.float32].bytes_on(axis) / 2, rel=0.01
        )


@needs_plugin
@pytest.mark.parametrize("nodes, per_node", [(2, 4), (2, 8)])
def test_on_gpus_bytegrad_moves_bfloat16_within_the_node_and_the_same_codes_between(
    nodes, per_node
):
    mesh = gpu_mesh(nodes, per_node)
    params = abstract(params_of(BF16))
    bf16 = compiled_rows(_step(mesh, "bytegrad"), params, batch_of())
    f32 = compiled_rows(_step(mesh, "bytegrad"), abstract(params_of(F32)), batch_of())
    local = {(r.kind, r.dtype) for r in bf16.rows if r.axes == "local"}
    assert local == {("reduce-scatter", "bf16"), ("all-gather", "bf16")}
    assert {r.dtype for r in f32.rows if r.axes == "local"} == {"f32"}
    assert bf16.bytes_on("local") == pytest.approx(f32.bytes_on("local") / 2, rel=0.01)
    assert bf16.bytes_on("node") == f32.bytes_on("node")
    assert any(r.dtype == "u8" and r.axes == "node" for r in bf16.rows)


@needs_plugin
def test_on_gpus_params_sharded_bfloat16_moves_bfloat16_within_the_node():
    """With shard="params" the partitioner gathers each layer and reduce-scatters its
    gradient within the node, in the params' dtype; between nodes the same codes cross."""
    mesh = gpu_mesh(2, 4)
    bf16 = compiled_rows(_step(mesh, "bytegrad", shard="params"), abstract(params_of(BF16)),
                         batch_of())  # fmt: skip
    replicated = compiled_rows(_step(mesh, "bytegrad"), abstract(params_of(BF16)), batch_of())
    local = [r for r in bf16.rows if r.axes == "local"]
    # All but the loss's mean and the float32 sum of b2's gradient (the loss casts b2).
    share = sum(r.bytes_sent for r in local if r.dtype == "bf16") / bf16.bytes_on("local")
    assert share > 0.99, local
    assert any(r.kind == "all-gather" and r.axes == "local" for r in bf16.rows)
    assert bf16.bytes_on("node") == pytest.approx(replicated.bytes_on("node"), rel=0.01)
    assert any(r.dtype == "u8" and r.axes == "node" for r in bf16.rows)
