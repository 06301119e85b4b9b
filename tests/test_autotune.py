"""autotune: the search, skipped failures, the cache, unchanged math, and agreement across
processes (2 processes over Gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import requires_gloo
from helpers import assert_trees_all_equal

import jax_bytegrad
from jax_bytegrad import SyncConfig
from jax_bytegrad._src import autotune as autotune_module
from jax_bytegrad._src.algorithms.diloco.estimate import estimate_diloco
from jax_bytegrad._src.codecs.integer import allreduce_width

REPO = Path(__file__).parent.parent
WORKER = Path(__file__).parent / "_mp_scripts" / "autotune_worker.py"
KIB, MIB = 2**10, 2**20


def _params():
    rng = np.random.default_rng(0)
    return {
        "w1": (rng.standard_normal((24, 64)) / 5).astype(np.float32),
        "b1": np.zeros(64, np.float32),
        "w2": (rng.standard_normal((64, 8)) / 8).astype(np.float32),
        "b2": np.zeros(8, np.float32),
    }


def _loss(params, batch):
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"][None])
    return jnp.mean((h @ params["w2"] + params["b2"][None] - y) ** 2)


def _batches(n, rows=32):
    rng = np.random.default_rng(1)
    return [
        (rng.standard_normal((rows, 24), np.float32), rng.standard_normal((rows, 8), np.float32))
        for _ in range(n)
    ]


_MESH = jax_bytegrad.make_mesh(2, 4)


def _strategy(name="bytegrad", **kwargs):
    return jax_bytegrad.Strategy(name, mesh=_MESH, **kwargs)


def _tune(strategy, **kwargs):
    kwargs = {"steps_per_trial": 2, "warmup_steps": 0, "verbose": False, **kwargs}
    return jax_bytegrad.autotune(strategy, _loss, optax.sgd(0.1), _params(), _batches(3), **kwargs)


# The search, on scores set by hand -----------------------------------------------------------


def _drive(search, score):
    """Runs a search with a made-up score per configuration; returns the configs tried."""
    tried = []
    while (index := search.next_index()) >= 0:
        tried.append(search.candidates[index])
        search.scores[index] = score(search.candidates[index])
    return tried


def test_a_small_space_is_swept_whole_from_the_start():
    space = {"a": (1, 2, 3), "b": (True, False)}
    search = autotune_module._Search(space, {"a": 2, "b": False}, max_trials=6)
    assert search.exhaustive
    tried = _drive(search, lambda c: c["a"] + (0 if c["b"] else 10))
    assert tried[0] == {"a": 2, "b": False}
    assert sorted(map(str, tried)) == sorted(map(str, search.candidates))
    assert search.best() == {"a": 1, "b": True}


def test_a_large_space_is_searched_one_setting_at_a_time():
    space = {"a": (1, 2, 3, 4, 5), "b": (10, 20, 30, 40), "c": (True, False)}
    search = autotune_module._Search(space, {"a": 3, "b": 20, "c": True}, max_trials=16)
    assert not search.exhaustive
    # Separable costs, best at a=5, b=10, c=False: the first pass (1 + 4 + 3 + 1 trials)
    # gets there, the second only confirms it (4 + 3 new points), and the search stops.
    tried = _drive(search, lambda c: abs(c["a"] - 5) + abs(c["b"] - 10) / 10 + c["c"])
    assert tried[8] == {"a": 5, "b": 10, "c": False}
    assert all(c["a"] == 5 for c in tried[5:9])  # each setting around the best before it
    assert len(tried) == 9 + 7
    assert len({str(c) for c in tried}) == len(tried)  # no configuration twice
    assert search.best() == {"a": 5, "b": 10, "c": False}


# Median step ms of ByteGrad + Adam on the 25.2M-parameter MLP, 2 namespace hosts at 1 Gbit/s,
# by bucket and message size (KiB; None: one message per peer): the exhaustive sweep of
# benchmarks/RESULTS.md ("Autotune", first run). The best message size depends on the bucket.
SWEPT_MS = {
    (4 * MIB, 256): 577.7, (4 * MIB, 512): 526.0, (4 * MIB, 1024): 573.0,
    (4 * MIB, 4096): 608.7, (4 * MIB, None): 683.6,
    (32 * MIB, 256): 686.6, (32 * MIB, 512): 661.3, (32 * MIB, 1024): 704.4,
    (32 * MIB, 4096): 608.6, (32 * MIB, None): 732.4,
    (None, 256): 610.7, (None, 512): 614.5, (None, 1024): 699.8,
    (None, 4096): 744.4, (None, None): 820.6,
}  # fmt: skip


def _swept(order):
    space = {
        "bucket_bytes": (4 * MIB, 32 * MIB, None),
        "message_bytes": (256, 512, 1024, 4096, None),
    }
    space = {name: space[name] for name in order}
    start = {"bucket_bytes": 32 * MIB, "message_bytes": 256}
    search = autotune_module._Search(space, start, max_trials=12)
    tried = _drive(search, lambda c: SWEPT_MS[c["bucket_bytes"], c["message_bytes"]])
    return search.best(), tried


def test_buckets_before_messages_finds_the_swept_best():
    best, tried = _swept(("bucket_bytes", "message_bytes"))
    assert best == {"bucket_bytes": 4 * MIB, "message_bytes": 512}  # 526 ms, the sweep's best
    assert len(tried) < len(SWEPT_MS)
    # Messages first stops at 608.6 ms (4 MiB messages suit 32 MiB buckets, not 4 MiB ones).
    best, _ = _swept(("message_bytes", "bucket_bytes"))
    assert SWEPT_MS[best["bucket_bytes"], best["message_bytes"]] == 608.6
    space = autotune_module._default_space(_strategy())
    assert list(space) == ["wire", "bucket_bytes", "hierarchical", "message_bytes"]


@pytest.mark.parametrize(
    "mesh_shape, kwargs, wires",
    [
        ((2, 4), {}, ("scatter_gather", "allreduce")),
        ((4, 2), {}, ("scatter_gather", "allreduce", "ring")),
        ((4, 2), {"bits": 4}, ("scatter_gather", "ring")),
        ((2, 4), {"bits": 4}, ("scatter_gather", "allreduce")),
        ((2, 4), {"bits": 4, "hierarchical": False}, ("scatter_gather", "ring")),
    ],
    ids=["2x4", "4x2", "4x2-4bit", "2x4-4bit", "2x4-4bit-flat"],
)
def test_the_wires_searched_are_those_that_run_on_the_mesh(mesh_shape, kwargs, wires):
    mesh = jax_bytegrad.make_mesh(*mesh_shape)
    strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh, **kwargs)
    assert autotune_module._default_space(strategy)["wire"] == wires


def test_message_size_is_not_searched_again_on_the_integer_wire():
    # One psum per bucket: message sizes there compile to the same program.
    space = {"wire": ("scatter_gather", "allreduce"), "message_bytes": (256, 512, None)}
    start = {"wire": "scatter_gather", "message_bytes": 256}
    search = autotune_module._Search(space, start, max_trials=16)
    allreduce = [c for c in search.candidates if c["wire"] == "allreduce"]
    assert allreduce == [{"wire": "allreduce", "message_bytes": 256}]
    assert len(search.candidates) == 4
    tried = _drive(search, lambda c: 1.0 if c["wire"] == "allreduce" else 2.0)
    assert len(tried) == 4 and search.best()["wire"] == "allreduce"


def test_the_auto_wire_starts_from_the_wire_it_runs():
    mesh = jax_bytegrad.make_mesh(2, 4)
    strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh, bucket_bytes=4 * MIB)
    strategy = strategy.replace(wire="auto")
    space, start = autotune_module._with_start(strategy, {"wire": ("scatter_gather", "ring")})
    assert start == {"wire": "allreduce"} and space["wire"][0] == "allreduce"


def test_failed_trials_are_never_best():
    search = autotune_module._Search({"a": (1, 2)}, {"a": 1}, max_trials=4)
    _drive(search, lambda c: float("nan") if c["a"] == 2 else 3.0)
    assert search.best() == {"a": 1}
    search = autotune_module._Search({"a": (1, 2)}, {"a": 1}, max_trials=4)
    _drive(search, lambda c: float("nan"))
    assert search.best() is None


# Real trials on 8 CPU devices -----------------------------------------------------------------


def test_tunes_real_steps_and_returns_a_ready_strategy(capsys):
    space = {"message_bytes": [KIB, None], "bucket_bytes": [2 * KIB, None]}
    result = _tune(_strategy(bits=4), space=space, verbose=True)
    # The start (256 KiB messages, 32 MiB buckets) is added to the space and measured first.
    assert result.start == {"message_bytes": 256 * KIB, "bucket_bytes": 32 * MIB}
    assert result.trials[0].config == result.start
    # None buckets the model as the start does (one bucket), so it is not timed twice.
    assert len(result.trials) == 3 * 2 and not result.from_cache
    assert {t.config["bucket_bytes"] for t in result.trials} == {32 * MIB, 2 * KIB}
    for trial in result.trials:
        assert trial.error is None
        assert trial.step_s > 0 and trial.compile_s >= 0
    best = min(result.trials, key=lambda t: t.step_s)
    assert result.config == best.config
    # The chosen strategy keeps the user's own settings, and trains.
    assert result.strategy.kwargs == {"bits": 4, **result.config}
    with result.strategy.train_step(_loss, optax.sgd(0.1)) as step:
        state, metrics = step(step.init(_params()), _batches(1)[0])
    assert np.isfinite(float(metrics["loss"]))
    out = capsys.readouterr().out
    assert out.count("autotune ") == 6 + 1 and "chose" in out  # + the uncompressed step
    assert "autotune uncompressed (gradient_allreduce): " in out and "compressed step is" in out
    # The uncompressed step ran for real beside the trials, and the table compares with it.
    assert result.uncompressed.config == {} and result.uncompressed.step_s > 0
    assert result.best_step_s == best.step_s and np.isfinite(result.speedup)
    table = result.table()
    assert table.count("\n") == 2 + 6 + 2 and "chosen" in table and "start" in table
    assert "| gradient_allreduce (uncompressed) |" in table and "Compression: " in table


def test_default_space_per_algorithm_and_mesh():
    bytegrad = autotune_module._default_space(_strategy())
    assert set(bytegrad) == {"wire", "message_bytes", "bucket_bytes", "hierarchical"}
    one_per_node = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(8, 1))
    assert "hierarchical" not in autotune_module._default_space(one_per_node)
    chosen = autotune_module._default_space(_strategy(message_bytes=None))
    assert "message_bytes" not in chosen  # the user's own setting is kept
    assert set(autotune_module._default_space(_strategy("decentralized"))) == {"message_bytes"}


def test_bucket_sizes_that_group_the_model_alike_are_timed_once():
    space = {"bucket_bytes": (4 * KIB, 16 * KIB, 32 * MIB, None)}
    start = {"bucket_bytes": 32 * MIB}
    # 2,120 floats: 4 KiB splits them (w1 alone), 16 KiB and up hold all of them in one bucket.
    kept = autotune_module._distinct_buckets(_strategy(), _params(), space, start)
    assert kept == {"bucket_bytes": (4 * KIB, 32 * MIB)}
    flat = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(2, 4), flatten=True)
    kept = autotune_module._distinct_buckets(flat, _params(), space, start)
    assert kept == {"bucket_bytes": (32 * MIB,)}  # one vector is one bucket at any size


def test_nothing_to_tune_returns_the_start_without_trials():
    result = _tune(_strategy("gradient_allreduce", hierarchical=True))
    assert result.trials == [] and result.config == {}
    assert result.strategy.kwargs == {"hierarchical": True}


def test_a_configuration_that_fails_is_skipped_with_a_warning():
    space = {"message_bytes": [-5, None]}  # -5 is rejected when the step is built
    with pytest.warns(UserWarning, match="skipped message_bytes=-5"):
        result = _tune(_strategy(), space=space)
    failed = [t for t in result.trials if t.error]
    assert [t.config for t in failed] == [{"message_bytes": -5}]
    assert "message_bytes" in failed[0].error and np.isnan(failed[0].step_s)
    assert result.config["message_bytes"] in (256 * KIB, None)


def test_a_configuration_that_fails_to_compile_is_skipped(monkeypatch):
    from jax_bytegrad._src.sync import wire

    slices = wire.message_slices

    def out_of_memory_at_1kib(blocks, block_bytes, message_bytes):
        if message_bytes == KIB:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while compiling")
        return slices(blocks, block_bytes, message_bytes)

    monkeypatch.setattr(wire, "message_slices", out_of_memory_at_1kib)
    with pytest.warns(UserWarning, match="RESOURCE_EXHAUSTED"):
        result = _tune(_strategy(wire="scatter_gather"), space={"message_bytes": [KIB, None]})
    assert [t.config["message_bytes"] for t in result.trials if t.error] == [KIB]
    assert result.config["message_bytes"] != KIB


def test_the_strategys_own_configuration_failing_is_the_users_error():
    def broken(params, batch):
        raise RuntimeError("a bug in the loss")

    with pytest.raises(RuntimeError, match="a bug in the loss"):
        jax_bytegrad.autotune(
            _strategy(), broken, optax.sgd(0.1), _params(), _batches(4), steps_per_trial=2
        )


def test_cache_round_trip(tmp_path):
    cache = tmp_path / "tune" / "autotune.json"
    space = {"message_bytes": [KIB, None]}
    first = _tune(_strategy(), space=space, cache=cache)
    entries = json.loads(cache.read_text())
    key = autotune_module.cache_key(_strategy(), _params())
    assert list(entries) == [key]
    assert entries[key]["config"] == first.config and entries[key]["trials"] == 3
    assert "bytegrad" in key and "node=2,local=4" in key and "params=2120" in key

    again = _tune(_strategy(), space=space, cache=cache)
    assert again.from_cache and again.trials == [] and again.config == first.config

    # Another algorithm setting is another key; a cached choice outside the space retunes.
    other = _tune(_strategy(bits=4), space=space, cache=cache)
    assert not other.from_cache and len(json.loads(cache.read_text())) == 2
    narrowed = _tune(_strategy(), space={"message_bytes": [2 * KIB]}, cache=cache)
    if first.config["message_bytes"] != 256 * KIB:
        assert not narrowed.from_cache


def test_an_unreadable_cache_is_ignored_with_a_warning(tmp_path):
    cache = tmp_path / "autotune.json"
    cache.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable cache"):
        result = _tune(_strategy(), space={"message_bytes": [None]}, cache=cache)
    assert not result.from_cache
    assert json.loads(cache.read_text())  # rewritten whole


def test_bad_arguments():
    with pytest.raises(ValueError, match="async has no setting"):
        _tune(_strategy("async"))
    with pytest.raises(ValueError, match="takes no setting 'sync_interval_ms'"):
        _tune(_strategy(), space={"sync_interval_ms": [10]})
    with pytest.raises(ValueError, match="space\\['message_bytes'\\] is empty"):
        _tune(_strategy(), space={"message_bytes": []})
    with pytest.raises(ValueError, match="max_trials must be an int >= 1"):
        _tune(_strategy(), max_trials=0)
    with pytest.raises(ValueError, match="needs 5 batches"):
        jax_bytegrad.autotune(
            _strategy(), _loss, optax.sgd(0.1), _params(), _batches(3), steps_per_trial=3
        )


def test_a_spent_time_budget_runs_no_trial():
    result = _tune(_strategy(), space={"message_bytes": [KIB, None]}, time_budget_s=0.0)
    assert len(result.trials) == 0 and result.config == result.start
    assert result.uncompressed is None and np.isnan(result.speedup)


# Does compression pay? The uncompressed step beside the trials, on timings set by hand --------


def _timed(monkeypatch, step_ms):
    """Replaces the timing of every trial: ``step_ms(strategy, config)`` milliseconds, no
    compile time; returns the list of (algorithm, config, optimizer) timed."""
    timed = []

    def fake(strat, config, loss_fn, optimizer, has_aux, params, batches, warmup, model):
        assert model == {"model_state": None, "rng_seed": None, "state_sync": "mean"}
        timed.append((strat.algorithm, dict(config), optimizer))
        return 0.0, step_ms(strat, config) / 1e3

    monkeypatch.setattr(autotune_module, "_run_trial", fake)
    return timed


SPACE = {"message_bytes": [KIB, None]}


def _bytegrad_ms(uncompressed):
    by_config = {KIB: 30.0, 256 * KIB: 20.0, None: 25.0}
    return lambda s, c: (
        uncompressed if s.algorithm == "gradient_allreduce" else by_config[c["message_bytes"]]
    )


@pytest.mark.parametrize("prefer", [False, True], ids=["default", "prefer_uncompressed"])
def test_a_compressed_step_that_pays_is_kept(monkeypatch, prefer):
    timed = _timed(monkeypatch, _bytegrad_ms(uncompressed=50.0))
    optimizer = optax.sgd(0.1)
    result = jax_bytegrad.autotune(
        _strategy(), _loss, optimizer, _params(), _batches(3), space=SPACE, steps_per_trial=2,
        warmup_steps=0, verbose=False, prefer_uncompressed=prefer,
    )  # fmt: skip
    # The uncompressed step is timed after the trials, once, with the caller's own optimizer,
    # and is not one of them.
    assert timed[-1] == ("gradient_allreduce", {}, optimizer)
    assert [t[0] for t in timed[:-1]] == ["bytegrad"] * 3 and len(result.trials) == 3
    assert result.config == {"message_bytes": 256 * KIB} and result.best_step_s == 0.020
    assert result.speedup == pytest.approx(2.5) and not result.fell_back
    assert result.strategy.algorithm == "bytegrad"
    assert "2.50x faster than the uncompressed one" in result.verdict()
    rows = result.table().splitlines()
    assert rows[2].startswith("| message_bytes=256KiB | 20.0 | 2.50x |") and "chosen" in rows[2]
    assert rows[-3].startswith("| gradient_allreduce (uncompressed) | 50.0 | 1.00x |")
    assert rows[-3].endswith("baseline |") and rows[-1].startswith("Compression: ")


def test_where_compression_loses_the_result_says_so_and_may_return_the_uncompressed_step(
    monkeypatch,
):
    _timed(monkeypatch, _bytegrad_ms(uncompressed=10.0))
    kwargs = {"space": SPACE}
    kept = _tune(_strategy(bits=4, node_axis="node"), **kwargs)
    assert kept.speedup == pytest.approx(0.5) and not kept.fell_back
    assert kept.strategy.algorithm == "bytegrad"  # opt-in only: the bytes saved may matter more
    assert "2.00x slower than the uncompressed one" in kept.verdict()
    back = _tune(_strategy(bits=4, node_axis="node"), prefer_uncompressed=True, **kwargs)
    assert back.fell_back and back.config == {"message_bytes": 256 * KIB}
    # gradient_allreduce on the same mesh, with the strategy's axes, not its codec settings.
    assert back.strategy.algorithm == "gradient_allreduce"
    assert back.strategy.kwargs == {"node_axis": "node"} and back.strategy.mesh is _MESH
    table = back.table()
    assert "| gradient_allreduce (uncompressed) | 10.0 | 1.00x | 0.0 | returned |" in table
    assert "| message_bytes=256KiB | 20.0 | 0.50x | 0.0 | best compressed, start |" in table
    assert "returned the uncompressed strategy" in table


def test_the_uncompressed_step_keeps_the_strategys_steps_settings():
    strategy = jax_bytegrad.Strategy(
        "bytegrad", mesh=_MESH, flatten=True, bits=4, hierarchical=False, donate=False
    )
    plain = autotune_module.uncompressed_strategy(strategy)
    assert plain.algorithm == "gradient_allreduce" and plain.flatten
    assert plain.kwargs == {"donate": False}  # hierarchy is gradient_allreduce's own default


def test_the_cache_remembers_whether_compression_paid(monkeypatch, tmp_path):
    cache = tmp_path / "autotune.json"
    timed = _timed(monkeypatch, _bytegrad_ms(uncompressed=10.0))
    first = _tune(_strategy(), space=SPACE, cache=cache)
    entry = json.loads(cache.read_text())[autotune_module.cache_key(_strategy(), _params())]
    assert entry["uncompressed_step_ms"] == pytest.approx(10.0)
    assert entry["step_ms"] == pytest.approx(20.0)
    timed.clear()
    again = _tune(_strategy(), space=SPACE, cache=cache, prefer_uncompressed=True)
    assert timed == [] and again.from_cache and again.config == first.config
    assert again.speedup == pytest.approx(0.5) and again.fell_back
    assert again.strategy.algorithm == "gradient_allreduce"


def test_an_uncompressed_step_that_fails_is_a_warning_and_no_fall_back(monkeypatch):
    def step_ms(strat, config):
        if strat.algorithm == "gradient_allreduce":
            raise RuntimeError("RESOURCE_EXHAUSTED: float32 gradients do not fit")
        return 20.0

    _timed(monkeypatch, step_ms)
    with pytest.warns(UserWarning, match="the uncompressed step failed: RuntimeError"):
        result = _tune(_strategy(), space=SPACE, prefer_uncompressed=True)
    assert "RESOURCE_EXHAUSTED" in result.uncompressed.error
    assert np.isnan(result.speedup) and not result.fell_back
    assert result.strategy.algorithm == "bytegrad"


def test_compare_uncompressed_off_times_no_uncompressed_step(monkeypatch):
    timed = _timed(monkeypatch, _bytegrad_ms(uncompressed=10.0))
    result = _tune(_strategy(), space=SPACE, compare_uncompressed=False)
    assert [t[0] for t in timed] == ["bytegrad"] * 3
    assert result.uncompressed is None and np.isnan(result.speedup)
    assert "uncompressed" not in result.table() and "chosen" in result.table()
    assert result.verdict() == "the uncompressed step was not timed"


@pytest.mark.parametrize(
    "strategy, kwargs, match",
    [
        ("qadam", {}, "qadam is not compared with the uncompressed step"),
        ("decentralized", {}, "decentralized is not compared"),
        ("bytegrad", {"compare_uncompressed": False}, "compare_uncompressed=False times no"),
        ("bytegrad", {"prefer_uncompressed": 1}, "prefer_uncompressed must be True or False"),
    ],
    ids=["qadam", "decentralized", "not-compared", "not-a-bool"],
)
def test_prefer_uncompressed_needs_an_uncompressed_step_to_compare(strategy, kwargs, match):
    kwargs = {"prefer_uncompressed": True, **kwargs}
    extra = {"learning_rate": 1e-3, "warmup_steps": 1} if strategy == "qadam" else {}
    with pytest.raises(ValueError, match=match):
        _tune(_strategy(strategy, **extra), **kwargs)


# The math does not depend on the tuned settings ------------------------------------------------


def _one_step(strategy):
    with strategy.train_step(_loss, optax.sgd(1.0)) as step:
        state, _ = step(step.init(_params()), _batches(1)[0])
        return jax.device_get(step.params(state)), state.params


@pytest.mark.slow  # a train step compiled per setting: 30-64 s on a loaded 2-core host
@pytest.mark.parametrize("bits", [8, 4])
def test_every_tunable_setting_keeps_the_average_within_the_quantization_bound(bits):
    exact, _ = _one_step(_strategy("gradient_allreduce"))
    # Codes span each block's range, at most twice the largest gradient of any one device.
    x, y = _batches(1)[0]
    per_device = [jax.grad(_loss)(_params(), (x[i : i + 4], y[i : i + 4])) for i in range(0, 32, 4)]
    grad_scale = {k: max(float(np.abs(g[k]).max()) for g in per_device) for k in exact}
    levels = 2**bits - 1
    default, _ = _one_step(_strategy(bits=bits))
    space = autotune_module._default_space(_strategy(bits=bits))
    for name, values in space.items():
        for value in values:
            got, placed = _one_step(_strategy(bits=bits, **{name: value}))
            # Scatter-gather: two roundings (node sum, then average), each half a level. The
            # integer wire: one, on a grid of fewer levels per node (headroom for the sum).
            strategy = _strategy(bits=bits, **{name: value})
            group = 2 if strategy.setting("hierarchical") else 8
            sync = SyncConfig(
                bits=bits,
                wire=strategy.setting("wire"),
                hierarchical=strategy.setting("hierarchical"),
            )
            wire = sync.group(2, 4).wire
            steps = levels if wire != "allreduce" else allreduce_width(bits, group).levels
            for k in got:
                bound = 2 * grad_scale[k] / steps + 1e-6
                err = np.abs(got[k] - exact[k]).max()
                assert err <= bound, (name, value, k, err, bound)
            # Replicas stay bit-identical on all 8 devices.
            for leaf in jax.tree.leaves(placed):
                shards = [np.asarray(s.data) for s in leaf.addressable_shards]
                for s in shards[1:]:
                    np.testing.assert_array_equal(s, shards[0])
            if name == "message_bytes":  # splitting messages changes no bit
                assert_trees_all_equal(got, default)


# Agreement across processes -------------------------------------------------------------------


@pytest.mark.slow
@requires_gloo
def test_processes_agree_on_every_trial_and_the_choice(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "jax_bytegrad.launch", "--nproc", "2", "--devices-per-proc", "2",
         "--timeout", "200", str(WORKER), str(tmp_path)],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, timeout=220, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    worker_space = [2**10, 256 * 2**10, None]
    # Process 1's budget of 0 s did not stop it: process 0 picks every trial.
    assert ranks[0]["trials"] == ranks[1]["trials"]
    tried = [t[0]["message_bytes"] for t in ranks[0]["trials"]]
    assert tried[0] == 256 * 2**10 and sorted(map(str, tried)) == sorted(map(str, worker_space))
    assert ranks[0]["config"] == ranks[1]["config"]
    assert ranks[0]["config"]["message_bytes"] in worker_space
    # Each score is the slower process's: the start, slowed on process 1 only, is never chosen.
    by_config = {str(t[0]["message_bytes"]): t[1] for t in ranks[0]["trials"]}
    assert by_config[str(256 * 2**10)] >= 5.0
    assert ranks[0]["config"] != {"message_bytes": 256 * 2**10}
    # Process 0 wrote the cache.
    assert json.loads((tmp_path / "cache.json").read_text())


# Would DiLoCo pay? An estimate from the link and the timed step --------------------------------


def _per_param(bits):
    """Bytes per parameter on the wire: the codes and a float32 scale and zero point a block."""
    return bits / 8 + 8 / SyncConfig(bits=bits).block_size


def test_the_diloco_estimate_is_the_bytes_on_the_link_over_h():
    params, nodes, link, step = 3_000_000, 4, 1.25e8, 0.08
    got = estimate_diloco(
        step, params=params, nodes=nodes, link_bytes_per_s=link, inner_steps=20, bits=4
    )
    share = 2 * (nodes - 1) / nodes * params  # each node's share of a ring's exchange
    exchange = share * _per_param(8) / link
    outer = share * _per_param(4) / link
    assert got.exchange_s == pytest.approx(exchange) and got.outer_s == pytest.approx(outer)
    assert got.compute_s == pytest.approx(step - exchange)
    assert got.diloco_step_s == pytest.approx(step - exchange + outer / 20)
    assert got.speedup == pytest.approx(step / (step - exchange + outer / 20))
    # A measured DiLoCo inner step replaces the serial model's compute; float32 is 4 bytes.
    given = estimate_diloco(step, params=params, nodes=nodes, link_bytes_per_s=link, bits=32,
                            compute_s=0.05)  # fmt: skip
    assert given.diloco_step_s == pytest.approx(0.05 + share * 4 / link / 50)
    with pytest.raises(ValueError, match="link_bytes_per_s must be a positive number"):
        estimate_diloco(step, params=params, nodes=nodes, link_bytes_per_s=0)


def test_the_background_estimate_waits_for_what_the_delay_steps_do_not_cover():
    # 10 ms of compute, a 45 ms outer exchange, H = 20: delay 5 covers it, 4 leaves 5 ms.
    got = estimate_diloco(0.02, params=1, nodes=2, link_bytes_per_s=1.0, inner_steps=20,
                          compute_s=0.01)  # fmt: skip
    got = got._replace(outer_s=0.045)
    assert got.background_delay == 5
    assert got.background_step_s(5) == pytest.approx(0.01)
    assert got.background_step_s(4) == pytest.approx(0.01 + 0.005 / 20)
    assert got.background_step_s(0) == pytest.approx(got.diloco_step_s)
    assert "delay=5 would hide the outer exchange: about 10.0 ms" in got.verdict()
    # An exchange longer than H - 1 steps cannot hide; nor can anything without compute.
    assert got._replace(outer_s=0.2).background_delay is None
    assert "background" not in got._replace(outer_s=0.2).verdict()
    assert got._replace(compute_s=0.0).background_delay is None


def test_autotune_says_whether_diloco_would_pay_on_the_link(monkeypatch):
    _timed(monkeypatch, _bytegrad_ms(uncompressed=50.0))  # the chosen step: 20 ms
    count = sum(np.size(x) for x in jax.tree.leaves(_params()))
    exchange = count * _per_param(8) / 0.015  # a link on which ByteGrad's exchange is 15 ms
    slow = _tune(_strategy(), space=SPACE, link_bytes_per_s=exchange, diloco_inner_steps=10)
    assert slow.diloco.exchange_s == pytest.approx(0.015)
    assert slow.diloco.diloco_step_s == pytest.approx(0.005 + 0.015 / 10)
    assert slow.diloco.pays and "it would pay" in slow.diloco.verdict()
    assert slow.table().splitlines()[-1].startswith("DiLoCo (estimated from the link): ")
    fast = _tune(_strategy(), space=SPACE, link_bytes_per_s=exchange * 100)
    assert fast.diloco.speedup == pytest.approx(0.02 / (0.02 - 0.00015 + 0.00015 / 50))
    assert not fast.diloco.pays and "would not pay" in fast.diloco.verdict()
    assert _tune(_strategy(), space=SPACE).diloco is None  # no link, no estimate
    with pytest.raises(ValueError, match="autotune: link_bytes_per_s must be a positive"):
        _tune(_strategy(), space=SPACE, link_bytes_per_s="1Gbit")
