"""QAdam: Adam equivalence in warm-up, the frozen phase, its traffic, replicas, checkpoints."""

import importlib.util
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import JitStep, assert_trees_all_close, assert_trees_all_equal

import jax_bytegrad
from jax_bytegrad import ScaleByQAdamState, qadam, refresh_steps, scale_by_qadam
from jax_bytegrad.profiling import communication_stats
from jax_bytegrad.sharding import replicate, shard_batch

AXES = ("node", "local")
NODES, LOCAL = 2, 4
DEVICES = NODES * LOCAL
IN, OUT = 48, 40  # 1960 parameters: two quantization blocks of 1024


@pytest.fixture(scope="module")
def mesh():
    return jax_bytegrad.make_mesh(NODES, LOCAL)


def init_params():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.standard_normal((IN, OUT)) * 0.1, jnp.float32),
        "b": jnp.zeros(OUT, jnp.float32),
    }


def make_batches(steps, seed=1, shape=(IN, OUT)):
    """Regression batches whose per-device slices differ, so local gradients differ too."""
    rng = np.random.default_rng(seed)
    true_w = rng.standard_normal(shape).astype(np.float32)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((DEVICES * 4, shape[0])).astype(np.float32)
        y = x @ true_w + rng.standard_normal((DEVICES * 4, shape[1])).astype(np.float32)
        out.append({"x": x, "y": y})
    return out


def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"][None]
    return jnp.mean((pred - batch["y"]) ** 2)


@jax.jit
def per_device_grads(params, batch):
    """Each device's gradient, stacked: the slices ``data_parallel_step`` gives them."""
    split = jax.tree.map(lambda x: x.reshape(DEVICES, -1, *x.shape[1:]), batch)
    return jax.vmap(jax.grad(loss_fn), in_axes=(None, 0))(params, split)


def zero_grad_loss(params, batch):
    """Zero gradients: only weight decay moves the params."""
    return jnp.float32(0.0) * loss_fn(params, batch)


def run(mesh, tx, batches, *, params=None, state=None, loss=loss_fn, step=None, trace=False):
    """Trains with ``data_parallel_step``; returns params, state, the step, and per-step copies.

    ``params`` and ``state`` default to fresh ones; given, they must already be placed.
    """
    if params is None:
        params, state = replicate((init_params(), tx.init(init_params())), mesh)
    step = JitStep(loss, tx, mesh) if step is None else step
    history = []
    for batch in batches:
        params, state, _ = step(params, state, shard_batch(batch, mesh))
        # One step in flight at a time: 8 host devices on 2 cores can otherwise starve a
        # device thread that a collective of the running step waits for.
        jax.block_until_ready((params, state))
        if trace:
            history.append(jax.device_get((params, state)))
    return params, state, step, history


def assert_replicas_identical(tree):
    """Every device holds the same bits of every leaf."""
    for leaf in jax.tree.leaves(tree):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        assert len(shards) == DEVICES
        for shard in shards[1:]:
            np.testing.assert_array_equal(shard, shards[0])


def compilations(step) -> int:
    """Programs built by a ``JitStep`` so far."""
    return step.compiles


def qadam_state(opt_state) -> ScaleByQAdamState:
    return opt_state[0]


def on_exact_mean_gradients(ref_tx, batches):
    """``ref_tx`` (plain optax) on one device, fed the exact mean of the per-device
    gradients of each batch: the (params, state) after every step."""

    @jax.jit
    def ref_step(params, state, grads):
        updates, state = ref_tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, history = init_params(), []
    with jax.numpy_dtype_promotion("standard"):
        state = ref_tx.init(params)
        for batch in batches:
            grads = jax.tree.map(
                lambda g: np.asarray(g, np.float64).mean(0).astype(np.float32),
                per_device_grads(params, batch),
            )
            params, state = ref_step(params, state, grads)
            history.append((params, state))
    return history


# --- warm-up is Adam --------------------------------------------------------------------


@pytest.mark.parametrize(
    "schedule, weight_decay",
    [(False, 0.0), (True, 0.1)],
    ids=["const-lr", "schedule-decay"],
)
def test_warmup_equals_adam_on_exact_mean_gradient(mesh, schedule, weight_decay):
    steps = 8
    lr = optax.linear_schedule(1e-2, 1e-3, steps) if schedule else 1e-2
    tx = qadam(lr, warmup_steps=steps + 100, weight_decay=weight_decay)
    batches = make_batches(steps)
    params, state, _, _ = run(mesh, tx, batches)

    ref_tx = optax.adamw(lr, weight_decay=weight_decay) if weight_decay else optax.adam(lr)
    ref_params, ref_state = on_exact_mean_gradients(ref_tx, batches)[-1]

    ours = qadam_state(state)
    assert int(ours.count) == steps
    expected = (ref_params, ref_state[0].mu, ref_state[0].nu)
    for leaf, ref in zip(
        jax.tree.leaves((params, ours.mu, ours.nu)), jax.tree.leaves(expected), strict=True
    ):
        for shard in leaf.addressable_shards:  # every device's copy
            np.testing.assert_allclose(np.asarray(shard.data), ref, rtol=2e-5, atol=1e-7)
    assert_replicas_identical((params, state))


# --- the compressed phase ---------------------------------------------------------------


def test_frozen_second_moment_and_its_bias_correction_freeze_after_warmup(mesh):
    warmup, steps, lr, b1, b2, eps = 3, 8, 1e-2, 0.9, 0.999, 1e-8
    tx = qadam(lr, warmup_steps=warmup, b1=b1, b2=b2, eps=eps, second_moment="frozen")
    _, _, _, hist = run(mesh, tx, make_batches(steps), trace=True)
    states = [qadam_state(s) for _, s in hist]
    frozen_nu = states[warmup - 1].nu
    assert np.any(np.asarray(states[warmup - 1].nu["w"]) != np.asarray(states[warmup - 2].nu["w"]))
    for t in range(warmup + 1, steps + 1):
        state = states[t - 1]
        assert int(state.count) == t
        assert_trees_all_equal(state.nu, frozen_nu)
        assert not np.array_equal(state.mu["w"], states[t - 2].mu["w"])
        # The step uses 1 - b1^t for m but 1 - b2^warmup for v. Bagua uses 1 - b2^t, a
        # step sqrt((1 - b2^t) / (1 - b2^warmup)) times larger: up to 1.63x here.
        prev_params, params = hist[t - 2][0], hist[t - 1][0]
        ours = adam_step(prev_params, state.mu, frozen_nu, lr, 1 - b1**t, 1 - b2**warmup, eps)
        assert_trees_all_close(params, ours, rtol=1e-5, atol=1e-7)
        bagua = adam_step(prev_params, state.mu, frozen_nu, lr, 1 - b1**t, 1 - b2**t, eps)
        assert not np.allclose(params["w"], bagua["w"], rtol=1e-5, atol=1e-7)


def adam_step(params, mu, nu, lr, mu_correction, nu_correction, eps):
    """``p - lr * (m / mu_correction) / (sqrt(v / nu_correction) + eps)`` in float32."""
    mu_c, nu_c, lr, eps = (np.float32(x) for x in (mu_correction, nu_correction, lr, eps))
    return jax.tree.map(
        lambda p, m, v: p - lr * (m / mu_c) / (np.sqrt(v / nu_c) + eps), params, mu, nu
    )


def test_momentum_is_the_compressed_mean_of_local_momenta(mesh):
    warmup, steps, b1 = 2, 4, 0.9
    tx = qadam(1e-2, warmup_steps=warmup, b1=b1)
    batches = make_batches(steps)
    _, _, _, hist = run(mesh, tx, batches, trace=True)
    for t in range(warmup + 1, steps + 1):
        params = hist[t - 2][0]
        prev_mu = qadam_state(hist[t - 2][1]).mu
        grads = jax.device_get(per_device_grads(params, batches[t - 1]))
        got = qadam_state(hist[t - 1][1]).mu
        for name in ("w", "b"):
            stacked = b1 * np.asarray(prev_mu[name], np.float64)[None] + (1 - b1) * np.asarray(
                grads[name], np.float64
            )
            exact = stacked.mean(0)
            # 8-bit codes: each element within a few quantization steps of the exact mean.
            step = (stacked.max() - stacked.min()) / 255
            err = np.abs(np.asarray(got[name], np.float64) - exact)
            assert err.max() <= 4 * step, (name, err.max(), step)
            assert err.max() > 0  # it really was quantized


# --- what crosses the network -----------------------------------------------------------


def compile_step(mesh, tx):
    """Compiles the one-program data-parallel step of ``tx`` (build it with the
    scatter-gather wire for the all_to_all / all_gather rows below)."""
    params = replicate(init_params(), mesh)
    state = replicate(tx.init(init_params()), mesh)
    batch = shard_batch(make_batches(1)[0], mesh)
    return JitStep(loss_fn, tx, mesh).lower(params, state, batch).compile()


@pytest.fixture(scope="module")
def frozen_step(mesh):
    """The compiled step of qadam without a refresh, shared by the tests below."""
    return compile_step(mesh, qadam(1e-2, warmup_steps=5, wire="scatter_gather"))


@pytest.fixture(scope="module", params=[None, 2], ids=["frozen-nu", "nu-refresh"])
def compiled_step(mesh, request):
    """The compiled ``data_parallel_step`` of qadam: both phases in one program.

    With a refresh, a refresh step takes the warm-up branch: still one conditional.
    """
    if request.param is None:
        return request.getfixturevalue("frozen_step")
    return compile_step(
        mesh, qadam(1e-2, warmup_steps=5, nu_refresh_interval=request.param, wire="scatter_gather")
    )


def _node_bytes(stats, kind=None, dtype=None):
    """Per-device operand bytes of the rows that cross nodes, optionally of one kind or dtype."""
    return sum(
        r.payload_bytes
        for r in stats.rows
        if "node" in r.axes.split("+")
        and (kind is None or r.kind == kind)
        and (dtype is None or r.dtype == dtype)
    )


def test_compressed_phase_sends_only_8bit_momentum_between_nodes(compiled_step, mesh):
    """Inspects the branches of the one conditional in the compiled train step.

    Both phases compile into one program, so the whole module's rows would mix them.
    ``communication_stats`` also reports each branch of the program's conditionals (with
    every computation a branch calls) and what lies outside them, which runs in both
    phases. Which branch is which is told by content, not by position, so XLA may reorder
    them.
    """
    stats = communication_stats(compiled_step, mesh=mesh)
    assert len(stats.branches) == 1, "expected both phases in one conditional"
    branches = stats.branches[0]
    assert len(branches) == 2
    compressed = [b for b in branches if any("u8" in r.dtype for r in b.rows)]
    assert len(compressed) == 1, "exactly one branch should carry uint8 codes"
    (compressed,) = compressed
    (warm,) = [b for b in branches if b is not compressed]
    n_params = IN * OUT + OUT

    # Warm-up: a float32 all-reduce of the whole gradient between nodes, no codes.
    assert all("u8" not in r.dtype for r in warm.rows)
    warm_f32_node = _node_bytes(warm, "all-reduce", "f32")
    assert warm_f32_node >= 4 * n_params / LOCAL  # hierarchical: each device sends 1/L

    # Compressed: no all-reduce at all; between nodes only uint8 codes and their headers.
    assert not [r for r in compressed.rows if r.kind == "all-reduce"]
    assert {r.kind for r in compressed.rows if "node" in r.axes.split("+")} == {
        "all-to-all",
        "all-gather",
    }
    assert {r.dtype for r in compressed.rows if "node" in r.axes.split("+")} <= {"u8", "f32"}
    u8 = _node_bytes(compressed, dtype="u8")
    f32 = _node_bytes(compressed, dtype="f32")
    assert u8 >= n_params / LOCAL  # each device's 1/L shard of the momentum, as codes
    assert f32 <= u8 * 8 / 1024 * 1.01  # headers: 8 bytes per 1024-element block

    # Outside the conditional, in both phases: only the scalar loss mean.
    outside = stats.unconditional
    assert outside.rows, "the loss mean runs outside the conditional"
    for r in outside.rows:
        assert (r.kind, r.dtype, r.payload_bytes) == ("all-reduce", "f32", 4 * r.count), r


def test_communication_stats_show_uint8_between_nodes(compiled_step, mesh):
    stats = communication_stats(compiled_step, mesh=mesh)
    # The whole program holds both phases: float32 for warm-up, uint8 codes after it.
    kinds = {(r.kind, r.axes, r.dtype) for r in stats.rows}
    assert ("all-to-all", "node", "u8") in kinds
    assert ("all-gather", "node", "u8") in kinds
    assert any(r.kind == "all-reduce" and r.dtype == "f32" and "node" in r.axes for r in stats.rows)


@pytest.mark.parametrize("growth", [1.0, 2.0], ids=["fixed", "doubling"])
def test_refresh_adds_no_collective_to_the_step(mesh, frozen_step, growth):
    """A refresh reuses the warm-up branch: the program's traffic rows are unchanged.

    With the branch test above (the compressed branch holds no all-reduce and no float32
    beyond block headers between nodes), the steps that do not refresh send no float32.
    """
    frozen = communication_stats(frozen_step, mesh=mesh)
    refresh = communication_stats(
        compile_step(
            mesh,
            qadam(
                1e-2,
                warmup_steps=5,
                nu_refresh_interval=3,
                nu_refresh_growth=growth,
                wire="scatter_gather",
            ),
        ),
        mesh=mesh,
    )
    assert refresh.rows == frozen.rows
    assert refresh.bytes_on("node") == frozen.bytes_on("node") > 0


@pytest.mark.parametrize("rule", ["momentum", "gradient"])
def test_phase_programs_train_as_the_one_program_form(mesh, rule):
    """The Strategy's QAdam runs one program per phase, picked on the host; the optax form
    runs both phases in one program under a lax.cond. Same steps, same state."""
    batches = make_batches(12)
    kwargs = dict(
        warmup_steps=4,
        nu_refresh_interval=3,
        nu_refresh_growth=1.0,
        weight_decay=0.01,
        second_moment=rule,
    )
    params, state, _, _ = run(mesh, qadam(1e-2, **kwargs), batches)
    strategy = jax_bytegrad.Strategy("qadam", mesh=mesh, learning_rate=1e-2, **kwargs)
    with strategy.train_step(loss_fn) as step:
        train = step.init(init_params())
        for batch in batches:
            train, _ = step(train, batch)
        assert step.phase_counts(train) == {"warmup": 6, "compressed": 6}  # t = 1-4, 7, 10
    assert int(qadam_state(train.opt_state).count) == 12
    assert_trees_all_close((train.params, train.opt_state), (params, state), rtol=1e-6, atol=1e-7)


# --- replicas, decay, schedule, no recompilation -----------------------------------------


@pytest.mark.parametrize("hierarchical", [True, False], ids=["hier", "flat"])
def test_replicas_bit_identical_after_50_steps_without_recompiling(mesh, hierarchical):
    tx = qadam(1e-2, warmup_steps=10, weight_decay=0.01, hierarchical=hierarchical)
    params, state, step, _ = run(mesh, tx, make_batches(50))
    assert int(qadam_state(state).count) == 50
    assert_replicas_identical((params, state))
    assert compilations(step) == 1  # the phase switch at step 11 did not recompile
    for leaf in jax.tree.leaves((params, state)):
        assert leaf.sharding.is_fully_replicated


@pytest.mark.parametrize("schedule", [False, True], ids=["const-lr", "schedule"])
def test_weight_decay_applies_in_both_phases_with_the_lr_schedule(mesh, schedule):
    """Zero gradients leave only decoupled decay: p <- p - lr_t * wd * p, every step."""
    warmup, steps, wd = 2, 6, 0.5
    lr = (lambda count: 0.01 * (count + 1).astype(jnp.float32)) if schedule else 0.01
    tx = qadam(lr, warmup_steps=warmup, weight_decay=wd)
    params, state, _, hist = run(mesh, tx, make_batches(steps), loss=zero_grad_loss, trace=True)
    expected = jax.device_get(jax.tree.map(np.asarray, init_params()))
    for t in range(1, steps + 1):
        lr_t = np.float32(0.01 * t if schedule else 0.01)
        expected = jax.tree.map(lambda p, lr_t=lr_t: p + (-lr_t) * (np.float32(wd) * p), expected)
        assert_trees_all_close(hist[t - 1][0], expected, rtol=1e-6, atol=0)
    assert int(qadam_state(state).count) == steps > warmup


# --- second-moment refresh --------------------------------------------------------------


REFRESH_KWARGS = dict(warmup_steps=3, weight_decay=0.01)


@pytest.fixture(scope="module")
def frozen_run(mesh):
    """(params, state) of 10 steps without a refresh; the default is checked to be that."""
    batches = make_batches(10)
    frozen = run(mesh, qadam(1e-2, **REFRESH_KWARGS, nu_refresh_interval=None), batches)
    default = run(mesh, qadam(1e-2, **REFRESH_KWARGS), batches)
    assert_trees_all_equal(frozen[:2], default[:2])
    return frozen[:2]


@pytest.mark.parametrize("growth", [1.0, 2.0], ids=["fixed", "doubling"])
def test_refresh_beyond_the_run_is_bit_identical_to_no_refresh(mesh, frozen_run, growth):
    """Until the first refresh, the refresh machinery changes no bit of any step."""
    late = run(
        mesh,
        qadam(1e-2, **REFRESH_KWARGS, nu_refresh_interval=100, nu_refresh_growth=growth),
        make_batches(10),
    )
    assert_trees_all_equal(late[:2], frozen_run)


@pytest.mark.parametrize(
    "interval, growth, expected",
    [
        (2, 2.0, [5, 9, 17]),  # W + 2, + 4, + 8
        (3, 1.0, [6, 9, 12, 15, 18]),  # every 3 steps
        (2, 1.5, [5, 8, 13, 19]),  # running sums 2, 5, 9.5, 16.25, rounded half up
    ],
    ids=["doubling", "fixed", "x1.5"],
)
def test_refresh_steps_land_on_the_schedule_without_recompiling(mesh, interval, growth, expected):
    warmup, steps = 3, 20
    assert refresh_steps(warmup, interval, growth, steps) == expected
    tx = qadam(
        1e-2,
        warmup_steps=warmup,
        second_moment="frozen",
        nu_refresh_interval=interval,
        nu_refresh_growth=growth,
    )
    params, state, step, hist = run(mesh, tx, make_batches(steps), trace=True)
    nus = [qadam_state(tx.init(init_params())).nu] + [qadam_state(s).nu for _, s in hist]
    # v moves on warm-up and refresh steps only, and stays bit-frozen on every other step.
    moved = [
        t
        for t in range(1, steps + 1)
        if not np.array_equal(np.asarray(nus[t]["w"]), np.asarray(nus[t - 1]["w"]))
    ]
    assert moved == [*range(1, warmup + 1), *expected]
    assert compilations(step) == 1  # every refresh ran in the one compiled program
    assert_replicas_identical((params, state))


def test_refresh_step_is_an_adam_step_on_the_exact_mean_gradient(mesh):
    """m and v take the float32 mean gradient; v's correction counts its W + r updates."""
    warmup, interval, steps, lr, b1, b2, eps = 3, 2, 10, 1e-2, 0.9, 0.999, 1e-8
    tx = qadam(
        lr,
        warmup_steps=warmup,
        b1=b1,
        b2=b2,
        eps=eps,
        second_moment="frozen",
        nu_refresh_interval=interval,
    )
    batches = make_batches(steps)
    _, _, _, hist = run(mesh, tx, batches, trace=True)
    schedule = refresh_steps(warmup, interval, 2.0, steps)
    assert schedule == [5, 9]
    for r, t in enumerate(schedule, start=1):
        prev_params, prev = hist[t - 2][0], qadam_state(hist[t - 2][1])
        state = qadam_state(hist[t - 1][1])
        grads = per_device_grads(prev_params, batches[t - 1])
        mean = jax.tree.map(lambda g: np.asarray(g, np.float64).mean(0), jax.device_get(grads))
        mu = jax.tree.map(lambda m, g: b1 * np.asarray(m, np.float64) + (1 - b1) * g, prev.mu, mean)
        nu = jax.tree.map(
            lambda v, g: b2 * np.asarray(v, np.float64) + (1 - b2) * g**2, prev.nu, mean
        )
        f32 = lambda tree: jax.tree.map(lambda x: np.asarray(x, np.float32), tree)  # noqa: E731
        # Not quantized: the float32 mean, to rounding (8-bit codes would be ~1e-2 off).
        assert_trees_all_close(state.mu, f32(mu), rtol=2e-5, atol=1e-7)
        assert_trees_all_close(state.nu, f32(nu), rtol=2e-5, atol=1e-9)
        params = hist[t - 1][0]
        ours = adam_step(prev_params, mu, nu, lr, 1 - b1**t, 1 - b2 ** (warmup + r), eps)
        # The step is ~lr per element. float32 leaves ~1e-5 of it: 1 - b2^n cancels, and
        # so may b1 m + (1 - b1) g.
        assert_trees_all_close(params, f32(ours), rtol=1e-5, atol=5e-5 * lr)
        # A correction of 1 - b2^t (Adam's, as if v had seen every step) differs visibly.
        adam_t = adam_step(prev_params, mu, nu, lr, 1 - b1**t, 1 - b2**t, eps)
        assert not np.allclose(params["w"], adam_t["w"], rtol=1e-5, atol=1e-7)
        if t < steps:
            # The compressed step after it keeps v, and v's correction, as the refresh left them.
            after = qadam_state(hist[t][1])
            assert_trees_all_equal(after.nu, state.nu)
            ours = adam_step(
                params, after.mu, after.nu, lr, 1 - b1 ** (t + 1), 1 - b2 ** (warmup + r), eps
            )
            assert_trees_all_close(hist[t][0], ours, rtol=1e-5, atol=5e-5 * lr)
            stale = adam_step(
                params, after.mu, after.nu, lr, 1 - b1 ** (t + 1), 1 - b2**warmup, eps
            )
            assert not np.allclose(hist[t][0]["w"], stale["w"], rtol=1e-5, atol=5e-5 * lr)


# --- errors ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        (dict(warmup_steps=0), "0"),
        (dict(warmup_steps=-3), "-3"),
        (dict(warmup_steps=2.5), "2.5"),
        (dict(warmup_steps=True), "True"),
        (dict(warmup_steps=10, b1=1.0), "1.0"),
        (dict(warmup_steps=10, b2=-0.1), "-0.1"),
        (dict(warmup_steps=10, eps=-1e-8), "-1e-08"),
        (dict(warmup_steps=10, block_size=100), "100"),
        (dict(warmup_steps=10, node_axis="x", local_axis="x"), "'x'"),
        (dict(warmup_steps=10, bucket_bytes=0), "0"),
        (dict(warmup_steps=10, weight_decay=-1.0), "-1.0"),
        (dict(learning_rate="fast", warmup_steps=10), "'fast'"),
        (dict(warmup_steps=10, nu_refresh_interval=-7), "got -7"),
        (dict(warmup_steps=10, nu_refresh_interval=2.5), "got 2.5"),
        (dict(warmup_steps=10, nu_refresh_interval=True), "got True"),
        (dict(warmup_steps=10, nu_refresh_interval="10"), "got '10'"),
        (dict(warmup_steps=10, nu_refresh_interval=5, nu_refresh_growth=0.5), "got 0.5"),
        (dict(warmup_steps=10, nu_refresh_growth=float("nan")), "got nan"),
        (dict(warmup_steps=10, nu_refresh_growth=float("inf")), "got inf"),
        (dict(warmup_steps=10, nu_refresh_interval=1, nu_refresh_growth=1 + 1e-6), "1.000001"),
    ],
    ids=lambda v: None if isinstance(v, dict) else v,
)
def test_bad_arguments_raise_at_build_time(kwargs, bad):
    kwargs = {"learning_rate": 1e-3, **kwargs}
    with pytest.raises(ValueError, match=re.escape(bad)):
        qadam(**kwargs)


def test_warmup_steps_is_required_and_positive():
    with pytest.raises(ValueError, match="warmup_steps must be an int in \\[1, "):
        scale_by_qadam(warmup_steps=0)
    with pytest.raises(TypeError):
        scale_by_qadam()  # keyword-only, no default: warm-up length is a real decision


@pytest.mark.parametrize(
    "first", [jax_bytegrad.bytegrad, jax_bytegrad.gradient_allreduce], ids=["bytegrad", "allreduce"]
)
def test_chaining_after_an_averaging_transform_raises(mesh, first):
    tx = optax.chain(first(), qadam(1e-2, warmup_steps=5))
    step = JitStep(loss_fn, tx, mesh)
    params = replicate(init_params(), mesh)
    state = replicate(tx.init(init_params()), mesh)
    batch = shard_batch(make_batches(1)[0], mesh)
    with pytest.raises(ValueError, match="would communicate twice") as info:
        step(params, state, batch)
    assert "['w']" in str(info.value) and "qadam(...) as the whole optimizer" in str(info.value)


def test_outside_shard_map_raises():
    tx = qadam(1e-2, warmup_steps=5)
    params = init_params()
    with pytest.raises(ValueError, match="must run inside jax.shard_map"):
        tx.update(params, tx.init(params), params)


# --- checkpoints across the phase switch -----------------------------------------------


@pytest.mark.parametrize(
    "warmup, stop, steps, refresh",
    [(4, 3, 9, None), (3, 7, 12, 2)],
    ids=["before-switch", "mid-refresh-schedule"],
)
def test_checkpoint_restores_bit_exactly(mesh, tmp_path, warmup, stop, steps, refresh):
    """Stops before the phase switch, or between two refreshes (steps 5 and 9 here)."""
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = qadam(
        optax.linear_schedule(1e-2, 1e-3, steps),
        warmup_steps=warmup,
        weight_decay=0.01,
        nu_refresh_interval=refresh,
    )
    if refresh is not None:
        schedule = refresh_steps(warmup, refresh, 2.0, steps)
        assert schedule[0] < stop < schedule[1]
    batches = make_batches(steps)
    straight_params, straight_state, step, _ = run(mesh, tx, batches)

    params, state, _, _ = run(mesh, tx, batches[:stop], step=step)
    path = tmp_path / "ckpt"
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path, {"params": params, "opt_state": state})
        ckptr.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": state})
    del params, state
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(path, abstract)
    assert int(qadam_state(restored["opt_state"]).count) == stop
    params, state, _, _ = run(
        mesh,
        tx,
        batches[stop:],
        params=restored["params"],
        state=restored["opt_state"],
        step=step,
    )
    assert int(qadam_state(state).count) == steps > warmup
    assert_trees_all_equal((params, state), (straight_params, straight_state))
    assert compilations(step) == 1


# --- convergence ------------------------------------------------------------------------


def _load_benchmark():
    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "qadam_convergence.py"
    spec = importlib.util.spec_from_file_location("qadam_convergence", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_converges_like_adam_on_a_small_transformer_lm(mesh):
    """A byte-level 2-layer transformer (d=64, context 64) on stdlib source, 2 x 4 devices."""
    bench = _load_benchmark()
    steps = 150
    adam_losses, adam_val = bench.train("adam", steps=steps, mesh=mesh)
    qadam_losses, qadam_val = bench.train("qadam", steps=steps, warmup_frac=0.2, mesh=mesh)
    assert adam_losses[0] > 5.0 and adam_val < 3.2, "the baseline did not learn"
    # Identical batches and initialisation: warm-up is Adam, so the curves agree there.
    np.testing.assert_allclose(qadam_losses[:29], adam_losses[:29], rtol=1e-3)
    assert abs(qadam_val - adam_val) <= 0.05 * adam_val, (qadam_val, adam_val)
    tail = slice(steps - 20, steps)
    assert np.mean(qadam_losses[tail]) <= 1.05 * np.mean(adam_losses[tail])


def test_qadam_binds_its_flat_keywords_into_the_sync_config_scale_by_qadam_takes(mesh):
    settings = dict(bits=4, block_size=256, wire="scatter_gather", hierarchical=False)
    batches = make_batches(3)
    sync = jax_bytegrad.SyncConfig(**settings)
    by_config = optax.chain(scale_by_qadam(warmup_steps=1, sync=sync), optax.scale(-1e-2))
    got = run(mesh, by_config, batches)[:2]
    assert_trees_all_equal(got[0], run(mesh, qadam(1e-2, warmup_steps=1, **settings), batches)[0])
    with pytest.raises(ValueError, match="scale_by_qadam: sync must be a jax_bytegrad.SyncConfig"):
        scale_by_qadam(warmup_steps=1, sync=settings)


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2], ids=["no-decay", "decay"])
@pytest.mark.parametrize("schedule", [False, True], ids=["float-lr", "schedule"])
def test_the_state_has_one_structure_whatever_the_arguments(weight_decay, schedule):
    lr = optax.linear_schedule(1e-2, 1e-3, 10) if schedule else 1e-2
    state = qadam(lr, warmup_steps=2, weight_decay=weight_decay).init({"w": jnp.ones(3)})
    assert len(state) == 2 and isinstance(state[0], jax_bytegrad.ScaleByQAdamState)
    plain = qadam(1e-2, warmup_steps=2).init({"w": jnp.ones(3)})
    assert jax.tree.structure(state[0]) == jax.tree.structure(plain[0])


@pytest.mark.parametrize("weight_decay", [0.0, 1e-2], ids=["no-decay", "decay"])
def test_a_checkpoint_of_the_earlier_chain_restores(tmp_path, weight_decay):
    """Before, qadam chained add_decayed_weights only with a decay: its state was (qadam,
    schedule) or (qadam, decay, schedule). Both restore into the one structure of today, the
    second with relayout=True (Checkpointer names it)."""
    from jax_bytegrad.checkpoint import Checkpointer

    lr = optax.linear_schedule(1e-2, 1e-3, 10)
    params = {"w": jnp.arange(3.0)}
    earlier = [scale_by_qadam(warmup_steps=2), optax.scale_by_learning_rate(lr)]
    if weight_decay:
        earlier.insert(1, optax.add_decayed_weights(weight_decay))
    first, *middle, schedule = optax.chain(*earlier).init(params)
    count = jnp.asarray(7, jnp.int32)
    saved = (first._replace(count=count), *middle, schedule._replace(count=count - 2))
    mesh = jax_bytegrad.make_mesh(1, 1)
    new = qadam(lr, warmup_steps=2, weight_decay=weight_decay).init(params)
    with Checkpointer(tmp_path, every=1) as ckpt:
        ckpt.save(1, saved)
        ckpt.wait()
        if weight_decay:
            with pytest.raises(ValueError, match="pass relayout=True"):
                ckpt.restore(1, lambda: new, mesh)
            restored = ckpt.restore(1, lambda: new, mesh, relayout=True)
        else:
            restored = ckpt.restore(1, lambda: new, mesh)
    assert int(restored[0].count) == 7 and int(restored[-1].count) == 5
    assert jax.tree.structure(restored) == jax.tree.structure(new)
