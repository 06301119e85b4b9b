"""Tests for the pipelined ByteGrad step (jax_bytegrad/_src/algorithms/bytegrad/pipelined.py).

The step cuts ``data_parallel_step(loss_fn, optax.chain(bytegrad(...), optimizer), mesh)``
into programs at the sync's collectives and runs the wire programs on a thread of its own.
It must compute the same state, bit for bit, on every mesh, wire and setting; keep its
replicas bit-identical; report the same traffic; and stop its thread on close, also when the
user's loop raises. Several processes over Gloo: tests/test_multiprocess_pipelined.py.
"""

import concurrent.futures
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import assert_replicas_bit_identical
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_bytegrad
from jax_bytegrad import SyncConfig
from jax_bytegrad._src.algorithms.bytegrad import pipelined
from jax_bytegrad._src.runtime import programs
from jax_bytegrad._src.steps.data_parallel import DataParallelStep
from jax_bytegrad.experimental import PipelinedMean
from jax_bytegrad.profiling import CommunicationStats, communication_stats
from jax_bytegrad.sharding import shard_batch

REPO = Path(__file__).resolve().parent.parent
AXES = ("node", "local")
STEPS = 3
# Small blocks and buckets: several buckets, and leaves cut into several pieces.
SMALL = dict(block_size=128, bucket_bytes=4096, message_bytes=512)


def _params(seed=0):
    # Leaves bucket in key order: b1, out and scale share bucket 0; w1 (2400 values) takes
    # bucket 1 in pieces. Two buckets keep each step's programs few (each compiles).
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.normal(size=(24, 100)) / 5).astype(np.float32),
        "b1": np.zeros(100, np.float32),
        "out": (rng.normal(size=(100, 6)) / 10).astype(np.float32),
        "scale": np.ones((), np.float32),
    }


def _loss(params, batch):
    x, y = batch
    h = jax.nn.relu(x @ params["w1"] + params["b1"][None])
    out = params["scale"] * (h @ params["out"])
    loss = jnp.mean((out - y) ** 2)
    return loss, {"mean_out": jnp.mean(out), "max_out": jnp.max(out)}


def _batches(n=STEPS, rows=16, seed=1):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=(rows, 24)).astype(np.float32),
            rng.normal(size=(rows, 6)).astype(np.float32),
        )
        for _ in range(n)
    ]


def _leaves(tree):
    out = []
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.asarray(leaf))
    return out


def _assert_bit_identical(actual, expected):
    a, e = _leaves(actual), _leaves(expected)
    assert len(a) == len(e)
    for x, y in zip(a, e, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def _run_both(mesh, sync, *, optimizer=None, steps=STEPS, has_aux=True, flatten=False, **kw):
    """Trains with the one-program step and the pipelined one; returns both (state, metrics)."""
    optimizer = optimizer or optax.adam(1e-2)
    average, seed = kw.pop("average", True), kw.pop("seed", 0)
    settings = {f: getattr(sync, f) for f in sync.__dataclass_fields__ if f != "where"}
    tx = optax.chain(
        jax_bytegrad.bytegrad(mesh=mesh, average=average, seed=seed, **settings), optimizer
    )
    loss = _loss if has_aux else (lambda p, b: _loss(p, b)[0])
    one = jax_bytegrad.data_parallel_step(loss, tx, mesh, has_aux=has_aux, flatten=flatten)
    out = []
    with jax_bytegrad.pipelined_step(
        loss, optimizer, mesh, sync=sync, average=average, seed=seed, has_aux=has_aux,
        flatten=flatten,
    ) as piped:  # fmt: skip
        for step in (one, piped):
            state = step.init(_params())
            for batch in _batches(steps):
                state, metrics = step(state, batch)
            out.append((state, metrics, step.params(state)))
    return out


# The same bits as the one-program step ----------------------------------------------------

CONFIGS = {
    # name: (mesh, sync settings). Each wire with and without error feedback and stochastic
    # rounding, one node per device (n x 1), nodes of several devices, flat, 4 bits. Each
    # setting runs once per wire, not in every combination: both wires' nearest rounding with
    # error feedback run flat (sg-flat-2x4-ef, ar-flat-2x4-ef), 2 nodes of 1 device run as
    # 8 x 1 and 2 x 4 do (sg-8x1-stochastic-ef, sg-2x4).
    "sg-2x4": ((2, 4), dict(wire="scatter_gather")),
    "sg-8x1-stochastic-ef": ((8, 1), dict(wire="scatter_gather", rounding="stochastic",
                                          error_feedback=True)),
    "ar-2x4-stochastic-ef": ((2, 4), dict(wire="allreduce", rounding="stochastic",
                                          error_feedback=True)),
    "ar-8x1-stochastic-ef": ((8, 1), dict(wire="allreduce", rounding="stochastic",
                                          error_feedback=True)),
    "ring-4x2-stochastic-ef": ((4, 2), dict(wire="ring", rounding="stochastic",
                                            error_feedback=True)),
    "sg-flat-2x4-ef": ((2, 4), dict(wire="scatter_gather", hierarchical=False,
                                    error_feedback=True)),
    "ar-flat-2x4-ef": ((2, 4), dict(wire="allreduce", hierarchical=False, error_feedback=True)),
    "sg4-2x4-ef": ((2, 4), dict(wire="scatter_gather", bits=4, block_size=256,
                                error_feedback=True)),
    "auto-2x4": ((2, 4), dict()),  # the default: the integer wire
    "ar4-2x4-stochastic": ((2, 4), dict(wire="allreduce", bits=4, block_size=256,
                                        rounding="stochastic")),
    "one-node-1x8-ef": ((1, 8), dict(wire="allreduce", error_feedback=True)),
    "one-device-1x1": ((1, 1), dict(wire="scatter_gather")),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS), ids=list(CONFIGS))
def test_the_pipelined_step_gives_the_one_program_steps_bits(name):
    shape, settings = CONFIGS[name]
    mesh = jax_bytegrad.make_mesh(*shape)
    sync = SyncConfig(**{**SMALL, **settings})
    (one_state, one_metrics, one_params), (state, metrics, params) = _run_both(mesh, sync)
    # Params, optimizer state (PRNG key, residuals and Adam's moments) and metrics. On one
    # node (1 x 8, 1 x 1) the pipelined step is the one-program step: nothing to compress.
    _assert_bit_identical(state.params, one_state.params)
    _assert_bit_identical(state.opt_state, one_state.opt_state)
    _assert_bit_identical(metrics, one_metrics)
    assert int(state.step) == int(one_state.step) == STEPS
    assert jax.tree.structure(state) == jax.tree.structure(one_state)
    assert not np.array_equal(params["w1"], _params()["w1"])  # it trained
    assert_replicas_bit_identical(state.params, devices=mesh.size)
    assert_replicas_bit_identical(state.opt_state[1], devices=mesh.size)
    for leaf in jax.tree.leaves(state.opt_state[0].residuals):
        assert leaf.sharding.spec == P(AXES)


def test_pieces_cut_leaves_and_the_wire_programs_alternate_with_compute():
    """The configs above do exercise the pipeline: leaves cut into several pieces, each with
    its own exchange, in a software-pipelined order."""
    mesh = jax_bytegrad.make_mesh(2, 4)
    sync = SyncConfig(wire="allreduce", **SMALL)
    with jax_bytegrad.pipelined_step(
        lambda p, b: _loss(p, b)[0], optax.sgd(0.1), mesh, sync=sync
    ) as step:
        state = step.init(_params())
        lowered = step.lower(state, _batches(1)[0])
    assert isinstance(lowered, jax_bytegrad.LoweredPrograms)
    names = list(lowered.programs)
    assert names[0] == "grad" and names[-1] == "update"
    psums = [n for n in names if n.startswith("psum")]
    # w1 (2400 values, 3072 padded) in 3 pieces of 4 KiB: its shard on 4 devices, 6 blocks.
    assert len([n for n in psums if n.startswith("psum1.")]) == 3, names
    # The encode of the next piece is dispatched before the decode of the one on the wire.
    assert names.index("encode1.1") < names.index("decode1.0")
    assert names.index("psum1.0") < names.index("decode1.0")
    for lowered_program in lowered.programs.values():
        assert isinstance(lowered_program, jax.stages.Lowered)
    # As a whole it is lowered text like one program's, every program's under its name.
    text = lowered.as_text()
    assert all(f"// {name}\n" in text for name in names)


def test_lower_from_shapes_compiles_every_program_as_one():
    """``lower`` takes ``state_shapes`` and a batch of ``ShapeDtypeStruct``, as every step's
    does; its ``LoweredPrograms`` compiles like one ``Lowered``, program by program."""
    mesh = jax_bytegrad.make_mesh(2, 4)
    batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _batches(1)[0])
    with jax_bytegrad.pipelined_step(_loss, optax.sgd(0.1), mesh, has_aux=True) as step:
        lowered = step.lower(step.state_shapes(_params()), batch)
        compiled = lowered.compile()
    assert list(compiled.programs) == list(lowered.programs)
    assert all(isinstance(c, jax.stages.Compiled) for c in compiled.programs.values())
    text = compiled.as_text()
    assert all(f"// {name}\n" in text for name in lowered.programs)
    assert "all-reduce" in compiled.programs["psum0.0"].as_text()


def test_bucket_size_changes_the_pieces_not_the_bits_of_the_integer_wire():
    # The integer wire's pieces depend on bucket_bytes; so do the buckets, and so the bits.
    # For one leaf bigger than every bucket size, only the pieces change: the same bits.
    mesh = jax_bytegrad.make_mesh(2, 4)
    x = np.random.default_rng(3).normal(size=(16, 2048)).astype(np.float32)

    def loss(params, batch):
        return jnp.mean((batch @ params["w"]) ** 2)

    results = []
    for bucket_bytes in (4096, 16384, None):
        sync = SyncConfig(wire="allreduce", block_size=128, bucket_bytes=bucket_bytes)
        with jax_bytegrad.pipelined_step(loss, optax.sgd(0.1), mesh, sync=sync) as step:
            state = step.init({"w": np.ones((2048, 4), np.float32) / 64})
            state, _ = step(state, x)
            pieces = [n for n in step.lower(state, x).programs if n.startswith("psum")]
            results.append((len(pieces), np.asarray(state.params["w"])))
    assert [p for p, _ in results] == [8, 2, 1]
    for _, params in results[1:]:
        np.testing.assert_array_equal(params, results[0][1])


def test_average_false_seed_and_flatten():
    mesh = jax_bytegrad.make_mesh(2, 4)
    sync = SyncConfig(wire="allreduce", rounding="stochastic", **SMALL)
    (one, one_metrics, _), (piped, metrics, _) = _run_both(
        mesh, sync, optimizer=optax.sgd(1e-3), average=False, seed=7, flatten=True
    )
    _assert_bit_identical((piped.params, piped.opt_state), (one.params, one.opt_state))
    _assert_bit_identical(metrics, one_metrics)
    assert piped.params.ndim == 1  # flattened


def test_without_aux_the_metrics_are_the_loss():
    mesh = jax_bytegrad.make_mesh(2, 4)
    (one, one_metrics, _), (piped, metrics, _) = _run_both(mesh, SyncConfig(**SMALL), has_aux=False)
    assert set(metrics) == {"loss"}
    _assert_bit_identical((piped, metrics), (one, one_metrics))


def test_the_sync_alone_gives_compressed_means_bits():
    """``PipelinedMean`` (benchmarks/network.py times it) against ``compressed_mean`` in one
    program, with error feedback's residuals."""
    from jax_bytegrad.experimental import residual_sizes

    rng = np.random.default_rng(5)
    for shape, wire in (((8, 1), "allreduce"), ((2, 4), "scatter_gather")):
        mesh = jax_bytegrad.make_mesh(*shape)
        kw = dict(wire=wire, rounding="stochastic", **SMALL)
        sharded = NamedSharding(mesh, P(AXES))
        g = jax.device_put(rng.normal(size=(8, 2500)).astype(np.float32), sharded)
        key = jax.device_put(jax.random.key(3), NamedSharding(mesh, P()))
        sizes = residual_sizes(jax.ShapeDtypeStruct((2500,), np.float32), SyncConfig(**kw), shape)
        residuals = jax_bytegrad.Residuals(
            tuple(
                jax.device_put(rng.normal(size=(8 * size,)).astype(np.float32), sharded)
                for size in pair
            )
            for pair in sizes
        )
        specs = jax.tree.map(lambda _: P(AXES), residuals)
        one = jax.jit(
            jax.shard_map(
                lambda g, key, r, kw=kw: jax_bytegrad.compressed_mean(
                    g[0], key=key, residuals=r, sync=SyncConfig(**kw)
                ),
                mesh=mesh,
                in_specs=(P(AXES), P(), specs),
                out_specs=(P(), specs),
            )
        )(g, key, residuals)
        mean = PipelinedMean(mesh, SyncConfig(error_feedback=True, **kw))
        try:
            got = mean(g, key, residuals)
        finally:
            mean.close()
        _assert_bit_identical(got, one)
        assert not np.array_equal(np.asarray(got[1][0][0]), np.asarray(residuals[0][0]))


def test_a_users_jit_of_the_chain_stays_one_program_with_the_same_bits():
    """``optax.chain(bytegrad(), adam)`` inside the user's own jit: one program, as before,
    and the pipelined step computes the same."""
    from helpers import JitStep

    mesh = jax_bytegrad.make_mesh(2, 4)
    sync = SyncConfig(wire="allreduce", error_feedback=True, **SMALL)
    tx = optax.chain(jax_bytegrad.bytegrad(mesh=mesh, wire="allreduce", error_feedback=True,
                                           **SMALL), optax.adam(1e-2))  # fmt: skip
    jitted = JitStep(_loss, tx, mesh, has_aux=True)
    reference = jax_bytegrad.data_parallel_step(_loss, tx, mesh, has_aux=True)
    state = reference.init(_params())
    params, opt_state = state.params, state.opt_state
    batches = [shard_batch(b, mesh) for b in _batches()]
    for batch in batches:
        params, opt_state, *_ = jitted(params, opt_state, batch)
    # One program holds the whole sync: the block bounds' pmax and the codes' integer psum.
    kinds = {
        (row.kind, row.dtype)
        for row in communication_stats(jitted.lower(params, opt_state, batches[0])).rows
    }
    assert {("all-reduce", "u8"), ("all-reduce", "f32")} <= kinds, kinds
    with jax_bytegrad.pipelined_step(_loss, optax.adam(1e-2), mesh, sync=sync, has_aux=True) as s:
        piped = s.init(_params())
        for batch in batches:
            piped, _ = s(piped, batch)
    # The user's jit and the library's steps compile with the same (XLA's default) options.
    _assert_bit_identical((piped.params, piped.opt_state), (params, opt_state))


# The TrainStep protocol ---------------------------------------------------------------------


def _pipelined(mesh=None, **sync):
    mesh = mesh or jax_bytegrad.make_mesh(2, 4)
    settings = {**SMALL, **sync}
    return jax_bytegrad.pipelined_step(
        _loss, optax.sgd(0.1), mesh, sync=SyncConfig(**settings), has_aux=True
    )


def test_communication_stats_are_the_one_program_steps_bytes():
    mesh = jax_bytegrad.make_mesh(2, 4)
    for wire in ("allreduce", "scatter_gather"):
        sync = SyncConfig(wire=wire, **SMALL)
        tx = optax.chain(jax_bytegrad.bytegrad(wire=wire, **SMALL), optax.sgd(0.1))
        one = jax_bytegrad.data_parallel_step(_loss, tx, mesh, has_aux=True)
        batch = _batches(1)[0]
        want = one.communication_stats(one.init(_params()), batch)["step"]
        with jax_bytegrad.pipelined_step(_loss, optax.sgd(0.1), mesh, sync=sync, has_aux=True) as s:
            state = s.init(_params())
            got = s.communication_stats(state, batch)
            lowered = s.lower(state, batch).programs
        assert set(got) == {"step"}
        got = got["step"]
        # The one-program step also agrees on the integer wire's decode factors (one int32
        # pmax); the pipelined step has its metrics program compute them instead.
        factors = [r for r in want.rows if r.dtype == "s32"]
        assert bool(factors) == (wire == "allreduce"), want
        want = CommunicationStats(
            tuple(r for r in want.rows if r.dtype != "s32"), want.axis_names, want.axis_sizes
        )
        for axis in ("node", "local"):
            assert got.bytes_on(axis) == pytest.approx(want.bytes_on(axis), rel=1e-12), wire
        assert got.bytes_on("node") > 0
        # The gradient program holds no collective: no hidden float32 all-reduce of the
        # gradient (params are made varying before differentiating).
        assert communication_stats(lowered["grad"]).rows == ()
        compute = [n for n in lowered if n.startswith(("encode", "quantize", "decode"))]
        assert compute
        for name in compute:
            assert communication_stats(lowered[name]).rows == (), name


def test_phase_counts_params_and_init():
    with _pipelined() as step:
        assert isinstance(step, jax_bytegrad.TrainStep)
        state = step.init(_params())
        assert step.phase_counts(state) == {"step": 0}
        for batch in _batches(2):
            state, metrics = step(state, batch)
        assert step.phase_counts(state) == {"step": 2}
        assert set(metrics) == {"loss", "aux"}
        assert metrics["loss"].sharding.spec == P()
        params = step.params(state)
        assert set(params) == set(_params())
        for leaf in jax.tree.leaves(params):
            assert leaf.sharding.spec == P()


def test_a_donated_state_cannot_be_stepped_twice():
    with _pipelined() as step:
        state = step.init(_params())
        batch = _batches(1)[0]
        step(state, batch)
        with pytest.raises(ValueError, match="deleted|consumed|donat"):
            step(state, batch)


def test_close_stops_the_dispatch_thread_and_refuses_more_steps():
    step = _pipelined()
    state = step.init(_params())
    state, _ = step(state, _batches(1)[0])
    assert step._wire.alive
    assert "pipelined_step-wire" in [t.name for t in threading.enumerate()]
    step.close()
    assert not step._wire.alive
    step.close()  # again: nothing
    with pytest.raises(RuntimeError, match="closed"):
        step(state, _batches(1)[0])


def test_a_users_loop_that_raises_stops_the_thread():
    strategy = jax_bytegrad.Strategy(
        "bytegrad", mesh=jax_bytegrad.make_mesh(2, 4), pipeline=True, wire="allreduce", **SMALL
    )
    with pytest.raises(KeyError, match="the user's own error"):
        with strategy.train_step(_loss, optax.sgd(0.1), has_aux=True) as step:
            state = step.init(_params())
            for i, batch in enumerate(_batches(3)):
                state, _ = step(state, batch)
                if i == 1:
                    raise KeyError("the user's own error")
    assert not step._wire.alive


def test_a_script_whose_loop_raises_exits_without_close():
    """No ``with``, no ``close``: the script's error ends the process at once (the dispatch
    thread is a daemon) with the traceback, instead of hanging at exit."""
    script = textwrap.dedent(
        """
        import jax
        jax.config.update("jax_num_cpu_devices", 2)
        import numpy as np, optax, jax_bytegrad
        mesh = jax_bytegrad.make_mesh(2, 1)
        step = jax_bytegrad.pipelined_step(
            lambda w, b: ((b @ w) ** 2).mean(), optax.sgd(0.1), mesh,
            sync=jax_bytegrad.SyncConfig(wire="allreduce"))
        state = step.init(np.ones((8, 2), np.float32))
        for i in range(3):
            state, _ = step(state, np.ones((4, 8), np.float32))
            if i == 1:
                raise RuntimeError("user error in the loop")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "user error in the loop" in proc.stderr
    assert time.monotonic() - start < 200


def test_an_error_in_a_step_stops_the_rest_of_its_wire_programs():
    """A compute program that fails after exchanges were handed to the thread: the ones not
    started are cancelled, the step raises, and the thread goes on serving later steps."""
    ran = []
    started, release = threading.Event(), threading.Event()

    def slow_wire(*_):
        started.set()
        release.wait(10)
        ran.append("first")
        return (1,)

    def later_wire(*_):
        ran.append("later")
        return (2,)

    def failing_compute(*_):
        started.wait(10)  # the first exchange is on the wire
        raise FloatingPointError("a program failed")

    tasks = [
        programs.Task("w1", "wire", slow_wire, (), ("a",)),
        programs.Task("w2", "wire", later_wire, (), ("b",)),
        programs.Task("c", "compute", failing_compute, (), ("c",)),
    ]

    class Schedule:
        pass

    schedule = Schedule()
    schedule.tasks, schedule.last_use = tasks, {}
    wire = programs.Dispatcher("test-wire")
    try:
        threading.Timer(0.2, release.set).start()
        with pytest.raises(FloatingPointError, match="a program failed"):
            programs.execute(schedule, {}, wire, keep=["a"])
        assert ran == ["first"]  # the second exchange never ran
        assert wire.submit(lambda: 3).result(timeout=10) == 3
    finally:
        wire.close()
    assert not wire.alive


def test_programs_pass_values_by_name_and_the_schedule_versions_each_chain():
    """A program reads and returns its values by name; a chain it updates gets a new name,
    ``Version(chain, n)``, after each update, and ``latest`` names the last one (the chain's
    own name, the value the step was given, where no program updates it)."""
    mesh = jax_bytegrad.make_mesh(2, 4)
    per_device = NamedSharding(mesh, P(AXES))
    x = jax.device_put(np.arange(16, dtype=np.float32), per_device)
    residual = jax.device_put(np.ones(16, np.float32), per_device)
    add = programs.Program("add", "compute", lambda v: {"r": v["r"] + v["x"]}, ["x"], chains=["r"])
    double = programs.Program("double", "compute", lambda v: {"y": 2 * v["r"]}, reads=["r"])
    values = {"x": x, "r": residual, "untouched": residual}
    abstract = {name: programs.Value(P(AXES), programs.aval(v)) for name, v in values.items()}
    schedule = programs.Schedule(
        [add, double, add], abstract, mesh, AXES, donate_state=False
    )  # fmt: skip
    assert [t.input_names for t in schedule.tasks] == [
        ("r", "x"), (programs.Version("r", 1),), (programs.Version("r", 1), "x")
    ]  # fmt: skip
    assert [t.output_names for t in schedule.tasks] == [
        (programs.Version("r", 1),), ("y",), (programs.Version("r", 2),)
    ]  # fmt: skip
    assert schedule.latest("r") == programs.Version("r", 2)
    assert schedule.latest("untouched") == "untouched"
    wire = programs.Dispatcher("test-names")
    try:
        keep = ["y", schedule.latest("r"), schedule.latest("untouched")]
        out = programs.execute(schedule, values, wire, keep)
    finally:
        wire.close()
    np.testing.assert_array_equal(out["y"], 2 * (1 + np.arange(16)))
    np.testing.assert_array_equal(out[programs.Version("r", 2)], 1 + 2 * np.arange(16))
    assert out["untouched"] is residual
    # Version 0, the state's, is donated only with donate_state.
    assert not residual.is_deleted()
    donating = programs.Schedule([add], abstract, mesh, AXES, donate_state=True)
    given = jax.device_put(np.ones(16, np.float32), per_device)
    wire = programs.Dispatcher("test-donate")
    try:
        programs.execute(donating, {"x": x, "r": given}, wire, [donating.latest("r")])
    finally:
        wire.close()
    assert given.is_deleted()


def test_dispatcher_keeps_the_order_and_hands_back_errors():
    wire = programs.Dispatcher("test-order")
    order = []
    futures = [wire.submit(order.append, i) for i in range(20)]
    bad = wire.submit(lambda: 1 / 0)
    concurrent.futures.wait(futures)
    assert order == list(range(20))
    with pytest.raises(ZeroDivisionError):
        bad.result(timeout=10)
    wire.close()


def test_bad_arguments_name_the_value_and_the_fix():
    mesh = jax_bytegrad.make_mesh(2, 4)
    with pytest.raises(ValueError, match="optax.GradientTransformation"):
        jax_bytegrad.pipelined_step(_loss, "adam", mesh)
    with pytest.raises(ValueError, match="SyncConfig"):
        jax_bytegrad.pipelined_step(_loss, optax.sgd(0.1), mesh, sync={"wire": "allreduce"})
    with pytest.raises(ValueError, match="seed"):
        jax_bytegrad.pipelined_step(_loss, optax.sgd(0.1), mesh, seed=-1)
    with pytest.raises(ValueError, match="4-bit|bits=8"):
        jax_bytegrad.pipelined_step(
            _loss, optax.sgd(0.1), jax_bytegrad.make_mesh(4, 2),
            sync=SyncConfig(wire="allreduce", bits=4),
        )  # fmt: skip
    with pytest.raises(ValueError, match="'bogus'"):
        jax_bytegrad.pipelined_step(_loss, optax.sgd(0.1), mesh, sync=SyncConfig(node_axis="bogus"))


# The strategy ----------------------------------------------------------------------------------


def test_strategy_pipeline_builds_the_pipelined_step_with_the_same_bits():
    mesh = jax_bytegrad.make_mesh(2, 4)
    kwargs = dict(wire="allreduce", error_feedback=True, rounding="stochastic", seed=3, **SMALL)
    out = []
    for pipeline in (False, True):
        strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh, pipeline=pipeline, **kwargs)
        with strategy.train_step(_loss, optax.adam(1e-2), has_aux=True) as step:
            assert isinstance(step, pipelined.PipelinedStep if pipeline else DataParallelStep)
            assert step.algorithm == "bytegrad"
            state = step.init(_params())
            for batch in _batches():
                state, metrics = step(state, batch)
            out.append((state, metrics))
    _assert_bit_identical(out[1], out[0])
    assert jax_bytegrad.Strategy("bytegrad", mesh=mesh).setting("pipeline") is False
    with pytest.raises(ValueError, match="pipeline"):
        jax_bytegrad.Strategy("bytegrad", mesh=mesh, pipeline="yes")
