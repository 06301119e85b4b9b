"""Train steps compiled for a GPU cluster on a machine without a GPU, and their schedules.

``sharding.gpu_mesh`` needs JAX's CUDA plugin (the ``cuda12`` extra, which CI's Python 3.12
leg installs); the tests that compile for deviceless H100s skip without it. The same
route (``state_shapes``, ``lower`` from ``ShapeDtypeStruct`` state and batch, ``compile``)
runs on the CPU mesh in every leg.
"""

import collections
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import gpu_plugin_error, load_script, needs_gpu_plugin

import jax_bytegrad as jbg
from jax_bytegrad import SyncConfig
from jax_bytegrad._src.codecs import selection
from jax_bytegrad._src.inspection import hlo
from jax_bytegrad._src.sync import collectives, config, wire
from jax_bytegrad.sharding import GPUS, gpu_mesh

ALGORITHMS = {
    "gradient_allreduce": {},
    "bytegrad": {},
    "bytegrad_4bit_ef": {"bits": 4, "error_feedback": True},
    "bytegrad_scatter_gather": {"wire": "scatter_gather"},
    "qadam": {"learning_rate": 1e-3, "warmup_steps": 2},
    "decentralized": {},
    "low_precision_decentralized": {},
    "async": {"sync_interval_ms": 0},
}


needs_plugin = needs_gpu_plugin()


def _strategy(name: str, mesh) -> jbg.Strategy:
    algorithm = name.split("_4bit")[0].split("_scatter")[0]
    return jbg.Strategy(algorithm, mesh=mesh, **ALGORITHMS[name])


# The benchmark's MLP (benchmarks/gpu_schedule.py), whose schedule RESULTS records.
GPU_SCHEDULE = load_script(
    Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_schedule.py"
)


def _mlp(dim: int, layers: int):
    params, loss_fn, _ = GPU_SCHEDULE.mlp(layers, dim)
    return params, loss_fn


def _cpu_mesh(name):
    # async needs each process to be one node: one process here.
    return jbg.make_mesh(1, 8) if name == "async" else jbg.make_mesh(2, 4)


def _step(name, mesh, loss_fn):
    optimizer = None if name == "qadam" else optax.adam(1e-3)
    return _strategy(name, mesh).train_step(loss_fn, optimizer)


def test_gpu_mesh_without_the_plugin_names_the_extra():
    if gpu_plugin_error() is None:
        pytest.skip("JAX's CUDA plugin is installed here; its absence is tested without it")
    # The package is on no index: the extra installs from the checkout.
    assert "pip install -e '.[cuda12]'" in gpu_plugin_error()


@pytest.mark.parametrize(("nodes", "per_node", "gpu"), [(0, 4, "h100"), (2, 4, "b200")])
def test_gpu_mesh_rejects_bad_arguments(nodes, per_node, gpu):
    with pytest.raises(ValueError, match="gpu_mesh: "):
        gpu_mesh(nodes, per_node, gpu)


def test_shipped_targets_are_what_xla_reads():
    text = GPUS["h100"].target_config()
    assert "cuda_compute_capability { major: 9 minor: 0 }" in text
    assert "core_count: 132" in text and 'platform_name: "CUDA"' in text
    assert GPUS["a100"].compute_capability == (8, 0)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_state_shapes_is_what_init_places(name):
    mesh = _cpu_mesh(name)
    params, loss_fn = _mlp(16, 2)
    with _step(name, mesh, loss_fn) as step:
        shapes = step.state_shapes(params)
        state = step.init([jnp.ones(p.shape, p.dtype) for p in params])
        assert jax.tree.structure(shapes) == jax.tree.structure(state)
        assert int(shapes.step) == int(state.step) == 0
        for want, got in zip(jax.tree.leaves(state), jax.tree.leaves(shapes), strict=True):
            if isinstance(want, np.ndarray):
                continue
            assert (got.shape, got.dtype) == (want.shape, want.dtype)
            assert got.sharding.is_equivalent_to(want.sharding, want.ndim)


@pytest.mark.parametrize("name", ["bytegrad", "qadam", "low_precision_decentralized"])
def test_lower_from_shapes_compiles_on_the_cpu_mesh(name):
    mesh = jbg.make_mesh(2, 4)
    params, loss_fn = _mlp(16, 2)
    batch = (jax.ShapeDtypeStruct((32, 16), jnp.float32),) * 2
    with _step(name, mesh, loss_fn) as step:
        state = step.state_shapes(params)
        compiled = step.lower(state, batch).compile()
        assert compiled.as_text()
        node = {p: s.bytes_on("node") for p, s in step.communication_stats(state, batch).items()}
        assert all(sent > 0 for phase, sent in node.items() if phase != "local")


@needs_plugin
@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_step_compiles_for_2x4_h100s(name):
    mesh = gpu_mesh(2, 4)
    assert mesh.devices[0, 0].device_kind == GPUS["h100"].name
    params, loss_fn = _mlp(256, 3)
    batch = (jax.ShapeDtypeStruct((64, 256), jnp.float32),) * 2
    with _step(name, mesh, loss_fn) as step:
        state = step.state_shapes(params)
        assert step.lower(state, batch).compile().as_text()
        for phase, stats in step.communication_stats(state, batch).items():
            overlap = stats.overlap_on("node")
            assert stats.bytes_on("node") >= 0 and overlap.gemms_beside <= overlap.gemms, phase
            # Every program but async's background averaging holds the MLP's gemms.
            assert overlap.gemms > 0 or phase == "averaging", (phase, overlap)


@needs_plugin
def test_implementation_none_runs_no_check_on_a_deviceless_mesh(monkeypatch):
    def check(kernel, device):
        raise AssertionError(f"checked {kernel} on {device}, which does not exist")

    monkeypatch.setattr(selection, "check", check)
    mesh = gpu_mesh(2, 4)
    params, loss_fn = _mlp(256, 2)
    batch = (jax.ShapeDtypeStruct((64, 256), jnp.float32),) * 2
    strategy = jbg.Strategy("bytegrad", mesh=mesh, wire="scatter_gather", implementation=None)
    with strategy.train_step(loss_fn, optax.sgd(0.1)) as step:
        assert step.lower(step.state_shapes(params), batch).compile().as_text()


@needs_plugin
def test_the_16_bit_integer_wire_warns_and_reports_its_promoted_bytes():
    mesh = gpu_mesh(4, 4)
    params, loss_fn = _mlp(128, 2)
    batch = (jax.ShapeDtypeStruct((64, 128), jnp.float32),) * 2

    def node_bytes(**settings):
        with jbg.Strategy("bytegrad", mesh=mesh, hierarchical=False, **settings).train_step(
            loss_fn, optax.sgd(0.1)
        ) as step:
            return step.communication_stats(step.state_shapes(params), batch)["step"]

    with pytest.warns(RuntimeWarning, match="promotes 16-bit integer all-reduces to 32 bits"):
        sixteen = node_bytes(wire="allreduce")
    # What XLA sends after the promotion: the codes go as 32-bit integers.
    assert any(row.dtype == "u32" for row in sixteen.rows)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        auto = node_bytes()  # "auto" picks the scatter-gather wire for 16 summing devices
    assert not [w for w in caught if "16-bit" in str(w.message)]
    assert SyncConfig().group(16, 1).wire == "scatter_gather"
    assert auto.total_bytes < sixteen.total_bytes / 3
    # Between nodes the margin is smaller: the flat all-to-all sends 12 of its 15 pieces to
    # other nodes, the flat ring all-reduce crosses on 4 of its 16 hops (docs/performance.md).
    assert auto.bytes_on("node") < 0.6 * sixteen.bytes_on("node")


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "phase"),
    [("bytegrad", "step"), ("bytegrad_4bit_ef", "step"), ("qadam", "compressed")],
)
def test_compressed_traffic_overlaps_the_backward_pass_on_h100s(name, phase):
    """The issue's MLP, eight 2048 x 2048 layers on 2 x 4 H100s: the compressed exchange
    between nodes runs beside at least as many gemms, and FLOPs, as the float32
    all-reduce's collectives."""
    mesh = gpu_mesh(2, 4)
    params, loss_fn = _mlp(2048, 8)
    batch = (jax.ShapeDtypeStruct((512, 2048), jnp.float32),) * 2

    def overlap(name, phase):
        with _step(name, mesh, loss_fn) as step:
            stats = step.communication_stats(step.state_shapes(params), batch)
            return stats[phase].overlap_on("node")

    baseline = overlap("gradient_allreduce", "step")
    compressed = overlap(name, phase)
    assert compressed.bytes_sent < baseline.bytes_sent / 3
    assert compressed.flops_beside >= baseline.flops_beside > 0, (compressed, baseline)
    assert compressed.gemms_beside >= baseline.gemms_beside, (compressed, baseline)


@needs_plugin
@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "settings", "phase"),
    [
        ("gradient_allreduce", {"hierarchical": True}, "step"),
        ("qadam", {"learning_rate": 1e-3, "warmup_steps": 2}, "warmup"),
    ],
    ids=["gradient_allreduce_hierarchical", "qadam_warmup"],
)
def test_the_float32_hierarchical_mean_overlaps_the_backward_pass_on_h100s(name, settings, phase):
    """The float32 mean within nodes then between them (gradient_allreduce(hierarchical=True),
    QAdam's warm-up) sends its buckets between nodes while the backward pass runs: without
    the ties between buckets, XLA:GPU merged them all after the last gemm (0%)."""
    mesh = gpu_mesh(2, 4)
    params, loss_fn = _mlp(2048, 8)
    batch = (jax.ShapeDtypeStruct((512, 2048), jnp.float32),) * 2
    strategy = jbg.Strategy(name, mesh=mesh, **settings)
    optimizer = None if name == "qadam" else optax.adam(1e-3)
    with strategy.train_step(loss_fn, optimizer) as step:
        stats = step.communication_stats(step.state_shapes(params), batch)
    overlap = stats[phase].overlap_on("node")
    assert overlap.early_share >= 0.5, overlap
    assert overlap.gemms_beside > 0, overlap


# The collective each wire stage of a plan compiles to.
STAGE_KINDS = {"psum": "all-reduce", "all_to_all": "all-to-all", "all_gather": "all-gather"}


@pytest.mark.parametrize("platform", ["cpu", "gpu"])
@pytest.mark.parametrize("wire_name", ["allreduce", "scatter_gather"])
def test_each_bucket_crosses_between_nodes_as_its_own_plan(platform, wire_name):
    """The step holds, for each bucket, the collectives of its wire's plan between nodes
    (``wire.integer_stages``, ``wire.scatter_gather_stages``): in the program as the library
    emits it, on any platform, and, compiled for H100s, as XLA:GPU runs it: none merged with
    another bucket's, which would make every bucket wait for the whole gradient. (XLA:CPU in
    JAX 0.10 drops the ties and merges them; a CPU program runs its collectives one at a
    time anyway.)"""
    if platform == "gpu" and gpu_plugin_error() is not None:
        pytest.skip(f"compiling for GPUs needs JAX's CUDA plugin: {gpu_plugin_error()}")
    mesh = gpu_mesh(2, 4) if platform == "gpu" else jbg.make_mesh(2, 4)
    params, loss_fn = _mlp(512, 4)  # four 1 MiB leaves
    sync = SyncConfig(wire=wire_name, bucket_bytes=2**20, message_bytes=None)
    plan = config.plan_sync(sync, jax.tree.leaves(params), (2, 4), platform, weight=1 / 8)
    layout, bucket = plan.layout, plan.buckets[0]
    stages = (
        wire.integer_stages(bucket, start=0, stop=1, feedback=False)
        if bucket.group.wire == "allreduce"
        else wire.scatter_gather_stages(bucket, held=((0, slice(0, 1)),), feedback=False)
    )
    want = {}
    for stage in stages:
        if stage.kind == "wire":
            kind = STAGE_KINDS[stage.name]
            want[kind] = want.get(kind, 0) + len(layout.buckets)
    assert len(layout.buckets) == 4
    settings = {"wire": wire_name, "bucket_bytes": 2**20, "message_bytes": None}
    with jbg.Strategy("bytegrad", mesh=mesh, **settings).train_step(
        loss_fn, optax.sgd(0.1)
    ) as step:
        batch = (jax.ShapeDtypeStruct((512, 512), jnp.float32),) * 2
        state = step.state_shapes(params)
        # The codes are the only 8-bit values any collective carries here.
        emitted = hlo.parse_collectives(step.lower(state, batch).as_text(dialect="hlo"))
        got = collections.Counter(c.kind for c in emitted if "u8" in c.dtypes)
        assert got == want, (got, want)
        if platform == "gpu":
            stats = step.communication_stats(state, batch)["step"]
            rows = [r for r in stats.rows if r.axes == "node" and r.dtype == "u8"]
            assert {r.kind: r.count for r in rows} == want, (rows, want)


@pytest.mark.parametrize("shard", [None, "optimizer"])
@pytest.mark.parametrize("platform", ["cpu", "gpu"])
def test_gpu_meshes_default_to_buckets_of_two_leaves(platform, shard):
    """``bucket_bytes="auto"``, the default, is 24 MiB buckets of at least two leaves on a GPU
    mesh and 32 MiB elsewhere (benchmarks/RESULTS.md, "The bucket grain on GPU meshes"). It
    is resolved from the mesh where error feedback sizes its residuals (``init``) and from
    the traced mesh where the sync runs, deviceless meshes included: the two agree, or the
    step would refuse the residuals. Each bucket's codes cross between nodes in one u8
    all-reduce (the integer wire), so they count the buckets."""
    if platform == "gpu" and gpu_plugin_error() is not None:
        pytest.skip(f"compiling for GPUs needs JAX's CUDA plugin: {gpu_plugin_error()}")
    mesh = gpu_mesh(2, 4) if platform == "gpu" else jbg.make_mesh(2, 4)
    params, loss_fn = _mlp(2304, 4)  # four leaves of 20.25 MiB
    buckets = 2 if platform == "gpu" else 4
    strategy = jbg.Strategy("bytegrad", mesh=mesh, error_feedback=True, shard=shard)
    with strategy.train_step(loss_fn, optax.sgd(0.1)) as step:
        state = step.state_shapes(params)
        found = jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, jbg.Residuals))
        assert [len(r) for r in found if isinstance(r, jbg.Residuals)] == [buckets]
        batch = (jax.ShapeDtypeStruct((64, 2304), jnp.float32),) * 2
        emitted = hlo.parse_collectives(step.lower(state, batch).as_text(dialect="hlo"))
        assert sum("u8" in c.dtypes for c in emitted) == buckets
        if platform == "gpu":
            rows = step.communication_stats(state, batch)["step"].rows
            assert sum(r.count for r in rows if r.axes == "node" and r.dtype == "u8") == buckets


@needs_plugin
@pytest.mark.slow
def test_the_gpu_default_overlaps_the_102m_transformer_as_the_float32_all_reduce_does():
    """The issue's 102M-parameter transformer (benchmarks/gpu_schedule.py's, dim 1024, depth
    8) on 2 x 4 H100s: with the GPU mesh's default buckets ByteGrad's traffic between nodes
    runs beside at least as many gemms, and FLOPs, as the float32 all-reduce's (RESULTS, "The
    bucket grain on GPU meshes": 51 against 40; 29 with the 32 MiB buckets of other
    platforms)."""
    mesh = gpu_mesh(2, 4)
    params, loss_fn, batch = GPU_SCHEDULE.transformer(1024, 8)
    leaves = jax.tree.leaves(params)
    layout = collectives.bucket_layout(leaves, SyncConfig(), (2, 4), "gpu")
    assert layout == collectives.bucket_layout(
        leaves, SyncConfig(), (2, 4), config.platform_of(mesh)
    )
    assert all(len(members) >= 2 for members in layout.buckets), layout.buckets
    plain = collectives.bucket_layout(leaves, SyncConfig(bucket_bytes=32 * 2**20), (2, 4))
    assert len(layout.buckets) > len(plain.buckets)

    def overlap(name):
        with _step(name, mesh, loss_fn) as step:
            stats = step.communication_stats(step.state_shapes(params), batch(8))
            return stats["step"].overlap_on("node")

    baseline, compressed = overlap("gradient_allreduce"), overlap("bytegrad")
    assert compressed.bytes_sent < baseline.bytes_sent / 3
    assert compressed.gemms_beside >= baseline.gemms_beside, (compressed, baseline)
    # And in FLOPs (37.6% against 32.3%): the gemms beside it are not only the small ones.
    assert compressed.flops_beside >= baseline.flops_beside, (compressed, baseline)


def test_state_shapes_carries_the_model_state_and_key():
    def loss_fn(params, batch, *, model_state, key):
        x, y = batch
        pred = x @ params[0] + jax.random.normal(key, y.shape) * 0.0
        return jnp.mean((pred - y) ** 2), {"count": model_state["count"] + 1}

    params = [jax.ShapeDtypeStruct((16, 16), jnp.float32)]
    batch = (jax.ShapeDtypeStruct((32, 16), jnp.float32),) * 2
    strategy = jbg.Strategy("bytegrad", mesh=jbg.make_mesh(2, 4))
    kwargs = dict(model_state={"count": np.int32(0)}, rng_seed=0)
    with strategy.train_step(loss_fn, optax.sgd(0.1), **kwargs) as step:
        shapes = step.state_shapes(params)
        state = step.init([jnp.ones((16, 16))])
        assert jax.tree.structure(shapes) == jax.tree.structure(state)
        assert shapes.extra.keys() == state.extra.keys() and len(state.extra) == 2
        assert step.lower(shapes, batch).compile().as_text()


@needs_plugin
@pytest.mark.slow
def test_the_docs_deviceless_example_runs(capsys):
    """docs/gpu.md's example, which test_docs.py cannot run without the plugin."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "gpu.md").read_text()
    source = next(b for b in page.split("```python\n")[1:] if "gpu_mesh(2, 4" in b)
    exec(compile(source.split("```")[0], "docs/gpu.md", "exec"), {})
    printed = capsys.readouterr().out
    # ByteGrad's exchange runs beside 12 of the 23 gemms, 52% of the FLOPs (RESULTS).
    assert "Overlap node:" in printed and float(printed.strip().splitlines()[-1]) >= 0.5
