"""Autotune: pick the system settings of a ``Strategy`` by timing the user's own train step.

Follows Bagua's performance autotuning (Gan et al., "Bagua: Scaling up Distributed Learning
with System Relaxations", VLDB 2022, Section 4.4): the settings that change only how the
gradient travels (bucket size, message size, hierarchical reduce), never what it averages to,
are chosen by measured step time, with every process agreeing on each choice.

Each trial builds the train step with one configuration, compiles it (timed apart), runs a few
untimed warm-up steps and then ``steps_per_trial`` timed ones on the same batches as every other
trial; its score is the median step time of the slowest process. Process 0 picks the next trial
and broadcasts it, so every process compiles the same program.

The search is exhaustive when the space has at most ``max_trials`` points. A larger space is
searched one setting at a time from the starting configuration (coordinate descent): every
value of the first setting with the others held, keep the fastest, then the next setting, and
again pass after pass until a pass moves nothing or the trials run out. Buckets and hierarchy
go before message size, whose best value depends on the exchanges they make;
benchmarks/RESULTS.md ("Autotune") measures the search against an exhaustive sweep. A
model-based search (Bagua uses scikit-optimize) pays off on spaces of hundreds of points, not
on these dozens, with a noisy score.

Beside its trials, ``autotune`` times the uncompressed step: ``gradient_allreduce`` with the same
optimizer. Compression does not always pay (on a fast link the codec's compute can cost more
than the bytes it saves, the "no speed-up" that users of 1-bit Adam, ZeRO++ and PowerSGD
report most often), so the result says how the best compressed step compares, and
``prefer_uncompressed=True`` returns the uncompressed strategy where it is faster.
"""

import itertools
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from jax_bytegrad._src import checks
from jax_bytegrad._src import strategy as strategy_lib
from jax_bytegrad._src.algorithms.diloco.estimate import check_link, estimate_diloco
from jax_bytegrad._src.autotune_results import (  # noqa: F401 - AutotuneResult, Trial: its API
    UNCOMPRESSED,
    AutotuneResult,
    Trial,
    cache_key,
    label,
    param_count,
    ratio,
    read_cache,
    write_cache,
)
from jax_bytegrad._src.axes import LOCAL_AXIS
from jax_bytegrad._src.codecs import integer
from jax_bytegrad._src.sync import buckets
from jax_bytegrad._src.sync.config import Group, SyncConfig, platform_of

# Candidate values, by setting. Message sizes: below 64 KiB per-message overhead dominates, and
# None (one message per peer) runs at about half the link rate through Gloo (benchmarks/
# RESULTS.md, "Line rate"). Bucket sizes: None is one bucket for the whole model.
MESSAGE_BYTES = (64 * 2**10, 128 * 2**10, 256 * 2**10, 512 * 2**10, 2**20, 4 * 2**20, None)
BUCKET_BYTES = (4 * 2**20, 16 * 2**20, 32 * 2**20, 128 * 2**20, None)
HIERARCHICAL = (True, False)
# Wires: which run on a mesh is filtered by ``_wires``.
WIRES = ("scatter_gather", "allreduce", "ring")
# The compressed algorithms timed against the uncompressed step, gradient_allreduce with the same
# optimizer. QAdam is its own optimizer, and its trials run inside its float32 warm-up.
COMPARED = ("bytegrad",)

_VALUES = {
    "message_bytes": MESSAGE_BYTES,
    "bucket_bytes": BUCKET_BYTES,
    "hierarchical": HIERARCHICAL,
    "wire": WIRES,
}


# Private helpers -------------------------------------------------------------------------


def _group(strat, **settings) -> Group:
    """Who sums the compressed codes on this mesh, over which wire (``SyncConfig.group``):
    the nodes, or all devices when flat."""
    nodes = strat.mesh.shape[strat.setting("node_axis")]
    local = strat.mesh.shape[strat.setting("local_axis")]
    sync = SyncConfig(hierarchical=strat.setting("hierarchical"), **settings)
    return sync.group(nodes, local)


def _wires(strat) -> tuple[str, ...]:
    """The wires worth timing on this mesh: the ring only from 3 nodes (at 2 every shift is
    the all_to_all's swap), the integer wire only where its codes fit (4 bits: 2 nodes)."""
    group = _group(strat).size
    keep = {"scatter_gather": True, "ring": group >= 3}
    keep["allreduce"] = integer.fits(strat.setting("bits"), group)
    return tuple(w for w in WIRES if keep[w])


def _concrete(strat, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with ``wire="auto"`` replaced by the wire it runs on this mesh, and
    ``bucket_bytes="auto"`` by its size where a size is all it means (off GPU meshes)."""
    config = dict(config)
    if config.get("bucket_bytes") == "auto":
        size, fewest = SyncConfig().bucket_grain(platform_of(strat.mesh))
        config["bucket_bytes"] = size if fewest == 1 else "auto"
    if config.get("wire") != "auto":
        return config
    return {**config, "wire": _group(strat, bits=strat.setting("bits")).wire}


def _default_space(strat) -> dict[str, tuple]:
    local_axis = strat.kwargs.get("local_axis", LOCAL_AXIS)
    space = {}
    for name in strategy_lib.tunable_settings(strat.algorithm):
        if name == "hierarchical" and strat.mesh.shape[local_axis] == 1:
            continue  # one device per node: both forms run the same program
        if name == "hierarchical" and strat.kwargs.get("shard") is not None:
            continue  # state split within the node: only the hierarchical sync runs
        if name in strat.kwargs:
            continue  # the user chose it
        space[name] = _wires(strat) if name == "wire" else _VALUES[name]
    return space


def _check_space(strat, space: Mapping[str, Sequence]) -> dict[str, tuple]:
    valid = strategy_lib.Strategy.valid_kwargs(strat.algorithm)
    checked = {}
    for name, values in space.items():
        if name not in valid:
            raise ValueError(
                f"autotune: {strat.algorithm} takes no setting {name!r}; "
                f"it takes {', '.join(valid)}"
            )
        values = tuple(values)
        if not values:
            raise ValueError(f"autotune: space[{name!r}] is empty; give at least one value")
        checked[name] = values
    return checked


def _with_start(strat, space: Mapping[str, tuple]) -> tuple[dict[str, tuple], dict[str, Any]]:
    """The space, with the configuration the strategy would run untuned added to it, and
    that configuration: the untuned step is always one of the trials."""
    start = _concrete(strat, {name: strat.setting(name) for name in space})
    space = {n: v if start[n] in v else (start[n], *v) for n, v in space.items()}
    return space, start


def _distinct_buckets(strat, params, space, start):
    """``space`` without bucket sizes that group ``params`` as another candidate does: the
    same buckets compile to the same program, and timing twins only measures noise."""
    if "bucket_bytes" not in space:
        return space
    leaves = jax.tree.leaves(params)
    if strat.flatten:  # the strategy trains one vector
        leaves = [jax.ShapeDtypeStruct((param_count(params),), np.float32)]
    kept, seen = [], {}
    platform = platform_of(strat.mesh)
    for value in sorted(space["bucket_bytes"], key=lambda v: v != start["bucket_bytes"]):
        size, fewest = SyncConfig(bucket_bytes=value).bucket_grain(platform)
        layout = buckets.make_layout(leaves, bucket_bytes=size, granularity=1, min_leaves=fewest)
        grouping = layout.buckets
        if grouping not in seen:
            seen[grouping] = value
            kept.append(value)
    values = tuple(v for v in space["bucket_bytes"] if v in kept)
    return {**space, "bucket_bytes": values}


def _agree(value: int) -> int:
    """Process 0's value, on every process."""
    if jax.process_count() == 1:
        return value
    return int(multihost_utils.broadcast_one_to_all(np.asarray(value, np.int32)))


def _agree_floats(values: Sequence[float]) -> list[float]:
    """Process 0's values, on every process."""
    if jax.process_count() == 1:
        return [float(v) for v in values]
    agreed = multihost_utils.broadcast_one_to_all(np.asarray(values, np.float64))
    return [float(v) for v in np.asarray(agreed)]


def _worst(values: Sequence[float]) -> np.ndarray:
    """Each entry's maximum over processes (NaN, a failed trial, wins)."""
    local = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return local
    return np.asarray(multihost_utils.process_allgather(local)).max(axis=0)  # NaN propagates


def uncompressed_strategy(strat):
    """``gradient_allreduce`` on the same mesh, with the strategy's own axes, step and
    ``flatten`` settings (hierarchy and the sync's settings are gradient_allreduce's defaults).

    Examples:
      >>> import jax_bytegrad
      >>> from jax_bytegrad._src.autotune import uncompressed_strategy
      >>> s = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(1, 1), bits=4)
      >>> uncompressed_strategy(s)
      Strategy('gradient_allreduce', mesh={'node': 1, 'local': 1})
    """
    shared = set(strategy_lib.Strategy.valid_kwargs(UNCOMPRESSED)) - set(
        strategy_lib.tunable_settings(UNCOMPRESSED)
    )
    kwargs = {k: v for k, v in strat.kwargs.items() if k in shared}
    return strategy_lib.Strategy(UNCOMPRESSED, mesh=strat.mesh, flatten=strat.flatten, **kwargs)


# The search ---------------------------------------------------------------------------------


def _diloco(strat, config, params, link_bytes_per_s, inner_steps, step_s):
    """The DiLoCo estimate of ``AutotuneResult.diloco``: None without a link, for another
    algorithm than ByteGrad, or without a timed step."""
    if link_bytes_per_s is None or strat.algorithm not in COMPARED or math.isnan(step_s):
        return None
    tuned = strat.replace(**config)
    return estimate_diloco(
        step_s, params=param_count(params), nodes=int(strat.mesh.shape[tuned.setting("node_axis")]),
        link_bytes_per_s=link_bytes_per_s, inner_steps=inner_steps,
        bytegrad_bits=tuned.setting("bits"), bytegrad_block_size=tuned.setting("block_size"),
    )  # fmt: skip


def _run_trial(strat, config, loss_fn, optimizer, has_aux, params, batches, warmup, model):
    """(compile_s, per-step seconds) of one configuration on this process; raises on failure."""
    tuned = strat.replace(**config)
    with tuned.train_step(loss_fn, optimizer, has_aux=has_aux, **model) as step:
        state = step.init(params)
        t0 = time.perf_counter()
        state, metrics = step(state, batches[0])
        jax.block_until_ready((state, metrics))
        first = time.perf_counter() - t0
        times = []
        for i in range(1, len(batches)):
            t0 = time.perf_counter()
            state, metrics = step(state, batches[i])
            jax.block_until_ready((state, metrics))
            if i > warmup:
                times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    return max(first - median, 0.0), median


class _Search:
    """Process 0's choice of the next configuration; every process keeps the same scores."""

    def __init__(self, space, start, max_trials):
        points = itertools.product(*space.values())
        # The integer wire sends one psum per bucket: its configurations that differ only in
        # message size compile to the same program, so only the start's message size is kept.
        self.candidates = [
            config
            for config in (dict(zip(space, v, strict=True)) for v in points)
            if config.get("wire") != "allreduce"
            or config.get("message_bytes") == start.get("message_bytes")
        ]
        self.exhaustive = len(self.candidates) <= max_trials
        if self.exhaustive:
            start_at = self.candidates.index(start)
            self._order = iter(self.candidates[start_at:] + self.candidates[:start_at])
        else:
            self._order = self._coordinate(space, start)
        self.scores: dict[int, float] = {}

    def _coordinate(self, space, start):
        """One setting at a time, pass after pass, until a pass moves nothing."""
        best = dict(start)
        yield best
        while True:
            before = best
            for name, values in space.items():
                for value in values:
                    if value != best[name]:
                        yield {**best, name: value}
                best = self.best() or best
            if best == before:
                return

    def best(self) -> dict[str, Any] | None:
        done = {i: s for i, s in self.scores.items() if not math.isnan(s)}
        if not done:
            return None
        return self.candidates[min(done, key=done.get)]

    def next_index(self) -> int:
        for config in self._order:
            if config not in self.candidates:
                continue  # a twin of a kept configuration
            index = self.candidates.index(config)
            if index not in self.scores:
                return index
        return -1


def _compares(strat, compare_uncompressed, prefer_uncompressed) -> bool:
    """Whether to time the uncompressed step; raises where ``prefer_uncompressed`` cannot work."""
    checks.boolean(compare_uncompressed, "compare_uncompressed", "autotune")
    checks.boolean(prefer_uncompressed, "prefer_uncompressed", "autotune")
    compare = compare_uncompressed and strat.algorithm in COMPARED
    if prefer_uncompressed and not compare:
        why = (
            "compare_uncompressed=False times no uncompressed step; leave it True"
            if strat.algorithm in COMPARED
            else f"{strat.algorithm} is not compared with the uncompressed step (only "
            f"{', '.join(COMPARED)} is); leave prefer_uncompressed False"
        )
        raise ValueError(f"autotune: prefer_uncompressed=True, but {why}")
    return compare


def _trial(config, run, *, fatal: bool, failed: str, stacklevel: int) -> Trial:
    """One configuration timed on every process, as the slowest process saw it: ``run()``
    gives (compile_s, step_s). A failure raises where ``fatal``, else it is a warning
    (``failed``, then the error) and a NaN trial."""
    error = None
    try:
        compile_s, step_s = run()
    except Exception as e:  # noqa: BLE001 - a configuration that cannot run is skipped
        if fatal:
            raise
        compile_s = step_s = math.nan
        error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
        warnings.warn(f"autotune: {failed}: {error}", stacklevel=stacklevel + 1)
    compile_s, step_s = (float(x) for x in _worst([compile_s, step_s]))
    if error is None and math.isnan(step_s):
        error = "failed on another process"
    return Trial(config, compile_s, step_s, error)


def _said(trial: Trial) -> str:
    """A trial's line of the progress output, after its label."""
    if trial.error:
        return f"failed ({trial.error})"
    return f"{1e3 * trial.step_s:.1f} ms/step, compile {trial.compile_s:.1f} s"


def _time_uncompressed(strat, loss_fn, optimizer, has_aux, params, batches, warmup, model, say):
    """The uncompressed step's trial (gradient_allreduce, the same optimizer), slowest process;
    a step that fails is a warning and a NaN trial, never the user's error."""
    plain = uncompressed_strategy(strat)
    trial = _trial(
        {},
        lambda: _run_trial(plain, {}, loss_fn, optimizer, has_aux, params, batches, warmup, model),
        fatal=False,
        failed="the uncompressed step failed",
        stacklevel=3,
    )
    say(f"autotune uncompressed ({UNCOMPRESSED}): {_said(trial)}")
    return trial


def _from_cache(path, key, search):
    """(index of the cached configuration among the candidates or -1, its step seconds, the
    uncompressed step's seconds), as process 0 read them, on every process."""
    hit, best_s, uncompressed_s = -1, math.nan, math.nan
    if jax.process_index() == 0:
        entry = read_cache(path, key) or {}
        if entry.get("config") in search.candidates:
            hit = search.candidates.index(entry["config"])
            best_s = (entry.get("step_ms") or math.nan) / 1e3
            uncompressed_s = (entry.get("uncompressed_step_ms") or math.nan) / 1e3
    hit, best_s, uncompressed_s = _agree_floats([hit, best_s, uncompressed_s])
    return int(hit), best_s, uncompressed_s


def _trial_batches(batches, warmup_steps: int, steps_per_trial: int) -> list:
    """The batches every trial reuses: one compiling step, the warm-up, the timed steps."""
    needed = 1 + warmup_steps + steps_per_trial
    batches = list(itertools.islice(iter(batches), needed))
    if len(batches) < needed:
        raise ValueError(
            f"autotune: needs {needed} batches (1 compiling + {warmup_steps} warm-up + "
            f"{steps_per_trial} timed steps), got {len(batches)}"
        )
    return batches


def _search_trials(search, run, start, max_trials: int, deadline, say) -> list:
    """Times the configurations ``search`` proposes, ``run(config)`` each, until it is done,
    ``max_trials`` ran or the ``deadline`` (``time.perf_counter()``) passed, every process
    agreeing on each one; returns the trials."""
    trials = []
    while len(trials) < max_trials:
        index = search.next_index()
        if deadline is not None and time.perf_counter() > deadline:
            index = -1
        index = _agree(index)
        if index < 0:
            break
        config = search.candidates[index]
        trial = _trial(
            config,
            lambda config=config: run(config),
            # The strategy's own configuration is the user's step: its error is theirs.
            fatal=config == start,
            failed=f"skipped {label(config)}",
            stacklevel=3,
        )
        search.scores[index] = trial.step_s
        trials.append(trial)
        say(f"autotune {len(trials):2d}: {label(config)}: {_said(trial)}")
    return trials


def _check_arguments(strategy, max_trials, steps_per_trial, warmup_steps, link_bytes_per_s,
                     diloco_inner_steps) -> None:  # fmt: skip
    """Raises ``ValueError`` on what autotune cannot tune or a bad count, before any trial."""
    if strategy.algorithm == "async":
        raise ValueError(
            "autotune: async has no setting that changes only speed (sync_interval_ms "
            "changes how stale the models are); tune the others, or pick the interval by hand"
        )
    checks.integer(max_trials, "max_trials", "autotune")
    checks.integer(steps_per_trial, "steps_per_trial", "autotune")
    checks.integer(warmup_steps, "warmup_steps", "autotune", minimum=0)
    if link_bytes_per_s is not None:
        check_link(link_bytes_per_s, diloco_inner_steps, "autotune")


def autotune(
    strategy,
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation | None,
    params: optax.Params,
    batches: Iterable,
    *,
    has_aux: bool = False,
    space: Mapping[str, Sequence] | None = None,
    max_trials: int = 16,
    steps_per_trial: int = 5,
    warmup_steps: int = 1,
    time_budget_s: float | None = None,
    cache: str | Path | None = None,
    verbose: bool = True,
    model_state: Any = None,
    rng_seed: int | None = None,
    state_sync: str = "mean",
    compare_uncompressed: bool = True,
    prefer_uncompressed: bool = False,
    link_bytes_per_s: float | None = None,
    diloco_inner_steps: int = 50,
) -> AutotuneResult:
    """Times a strategy's train step under several system settings and returns the fastest.

    The trials train copies of ``params``; the caller's params and the math are untouched:
    every setting tuned here gives the same average up to the documented quantization bound
    (message size: bit for bit), and replicas stay bit-identical under each. Call it on every
    process, with the same arguments, before training.

    Args:
      strategy: the ``Strategy`` to tune; its own keyword arguments are kept, and settings it
        sets explicitly are not tuned by the default space.
      loss_fn, optimizer, has_aux: as for ``strategy.train_step``.
      params: the initial model (the same on every process); only copies are trained.
      batches: this process's batches, as ``train_step`` takes them; the first
        ``1 + warmup_steps + steps_per_trial`` are drawn once and reused by every trial.
      space: ``{setting: candidate values}``; by default the algorithm's system settings:
        ``wire`` (those of ``WIRES`` that run on the mesh), ``bucket_bytes``
        (``BUCKET_BYTES``), ``hierarchical`` (with more than one device per node) and
        ``message_bytes`` (``MESSAGE_BYTES``), for ByteGrad and QAdam;
        ``hierarchical`` for gradient_allreduce; ``message_bytes`` for the decentralized
        pair. Any keyword the strategy takes may be given (``block_size``, ...).
      max_trials: the most configurations to measure. A space with at most this many points
        is swept whole; a larger one is searched one setting at a time, in the space's order.
      steps_per_trial: timed steps per trial (their median is the trial's score).
      warmup_steps: untimed steps after the compiling first step.
      time_budget_s: no new trial starts after this many seconds (process 0's clock).
      cache: a JSON file of chosen configurations keyed by ``cache_key``; a hit skips the
        tuning, and a new result is written there (by process 0).
      verbose: print a line per trial on process 0.
      model_state, rng_seed, state_sync: as for ``strategy.train_step``.
      compare_uncompressed: for ByteGrad, also time the uncompressed step
        (``gradient_allreduce`` with the same optimizer, on the same batches, after the
        trials and not counted in ``max_trials``): the result's ``speedup`` and ``table()``
        then say whether compression pays on this link.
      prefer_uncompressed: return the uncompressed strategy (``result.fell_back``) when its
        step was faster than the best compressed one. Off by default: the bytes saved may
        matter more than this run's speed (a shared link, a larger job later).
      link_bytes_per_s: for ByteGrad, the measured link between nodes (bytes per second per
        node): the result's ``diloco`` then estimates a DiLoCo inner step at
        ``diloco_inner_steps`` (8-bit outer exchange) against the chosen step, and says
        whether it would pay (``algorithms/diloco/estimate.estimate_diloco``; docs/diloco.md).
      diloco_inner_steps: DiLoCo's H for that estimate.

    Returns:
      An ``AutotuneResult``: ``config``, ``strategy`` (ready to use), ``trials``, ``start``,
      ``tuning_s``, ``from_cache``, ``uncompressed``, ``best_step_s``, ``fell_back``,
      ``speedup``, ``verdict()`` and ``table()``.

    Raises:
      ValueError: for async (nothing of it can be tuned without changing its math), a
        ``link_bytes_per_s`` that is not a positive number, a setting
        the algorithm does not take, an empty candidate list, bad counts, too few batches, or
        ``prefer_uncompressed`` for an algorithm other than ByteGrad or without
        ``compare_uncompressed``.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> strategy = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(1, 1))
      >>> loss_fn = lambda w, b: jnp.mean((b @ w) ** 2)
      >>> batches = [jnp.ones((8, 4))] * 4
      >>> result = jax_bytegrad.autotune(strategy, loss_fn, optax.sgd(0.1), jnp.ones(4),
      ...     batches, space={"message_bytes": [2**16, None]}, steps_per_trial=2, verbose=False)
      >>> len(result.trials), result.start  # the default, 256 KiB, is always measured
      (3, {'message_bytes': 262144})
      >>> result.strategy.kwargs["message_bytes"] in (2**16, 2**18, None)
      True
      >>> result.uncompressed.config, result.speedup > 0  # gradient_allreduce, timed beside
      ({}, True)
    """
    t_start = time.perf_counter()
    _check_arguments(strategy, max_trials, steps_per_trial, warmup_steps, link_bytes_per_s,
                     diloco_inner_steps)  # fmt: skip
    compare = _compares(strategy, compare_uncompressed, prefer_uncompressed)
    space = _default_space(strategy) if space is None else _check_space(strategy, space)
    space, start = _with_start(strategy, space)
    space = _distinct_buckets(strategy, params, space, start)
    batches = _trial_batches(batches, warmup_steps, steps_per_trial)
    say = print if verbose and jax.process_index() == 0 else (lambda *a, **k: None)
    search = _Search(space, start, max_trials)

    def result(config, trials, from_cache, uncompressed=None, best_s=math.nan):
        timed = [t.step_s for t in trials if t.config == config and not math.isnan(t.step_s)]
        best_s = min(timed, default=best_s)
        fell_back = (
            prefer_uncompressed
            and uncompressed is not None
            and ratio(uncompressed.step_s, best_s) < 1
        )
        return AutotuneResult(
            config=config,
            strategy=uncompressed_strategy(strategy) if fell_back else strategy.replace(**config),
            trials=trials,
            start=start,
            tuning_s=time.perf_counter() - t_start,
            from_cache=from_cache,
            uncompressed=uncompressed,
            best_step_s=best_s,
            fell_back=fell_back,
            diloco=_diloco(strategy, config, params, link_bytes_per_s, diloco_inner_steps, best_s),
        )

    path = None if cache is None else Path(cache)
    if path is not None:
        key = cache_key(strategy, params)
        hit, best_s, uncompressed_s = _from_cache(path, key, search)
        if hit >= 0:
            say(f"autotune: {label(search.candidates[hit])} (from {path})")
            cached = None
            if compare and not math.isnan(uncompressed_s):
                cached = Trial({}, math.nan, uncompressed_s)
            return result(search.candidates[hit], [], True, cached, best_s)

    if len(search.candidates) == 1:
        return result(start, [], False)
    say(
        f"autotune: {strategy.algorithm}, {len(search.candidates)} configurations, "
        f"{'exhaustive' if search.exhaustive else 'one setting at a time'}, "
        f"at most {max_trials} trials"
    )
    model = dict(model_state=model_state, rng_seed=rng_seed, state_sync=state_sync)

    def run(config):
        return _run_trial(
            strategy, config, loss_fn, optimizer, has_aux, params, batches, warmup_steps, model
        )

    deadline = None if time_budget_s is None else t_start + time_budget_s
    trials = _search_trials(search, run, start, max_trials, deadline, say)
    measured = search.best()  # None: no trial ran within the time budget
    best = measured or start
    uncompressed = None
    if compare and measured is not None:  # after the start's trial: a broken loss is raised there
        uncompressed = _time_uncompressed(
            strategy, loss_fn, optimizer, has_aux, params, batches, warmup_steps, model, say
        )
    found = result(best, trials, False, uncompressed)
    if path is not None and jax.process_index() == 0 and measured is not None:
        write_cache(path, key, found)
    say(f"autotune: chose {label(best)} in {found.tuning_s:.1f} s")
    if uncompressed is not None:
        say(f"autotune: {found.verdict()}")
    if found.diloco is not None:
        say(f"autotune: {found.diloco.verdict()}")
    return found
