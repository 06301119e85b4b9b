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
"""

import itertools
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from jax_bytegrad._src import buckets, checks
from jax_bytegrad._src import strategy as strategy_lib
from jax_bytegrad._src.codecs import integer
from jax_bytegrad._src.config import SyncConfig

# Candidate values, by setting. Message sizes: below 64 KiB per-message overhead dominates, and
# None (one message per peer) runs at about half the link rate through Gloo (benchmarks/
# RESULTS.md, "Line rate"). Bucket sizes: None is one bucket for the whole model.
MESSAGE_BYTES = (64 * 2**10, 128 * 2**10, 256 * 2**10, 512 * 2**10, 2**20, 4 * 2**20, None)
BUCKET_BYTES = (4 * 2**20, 16 * 2**20, 32 * 2**20, 128 * 2**20, None)
HIERARCHICAL = (True, False)
# Wires: which run on a mesh is filtered by ``_wires``.
WIRES = ("scatter_gather", "allreduce", "ring")

_VALUES = {
    "message_bytes": MESSAGE_BYTES,
    "bucket_bytes": BUCKET_BYTES,
    "hierarchical": HIERARCHICAL,
    "wire": WIRES,
}


# Private helpers -------------------------------------------------------------------------


def _group_size(strat) -> int:
    """How many devices sum the compressed codes: the nodes, or all devices when flat."""
    nodes = strat.mesh.shape[strat.setting("node_axis")]
    local = strat.mesh.shape[strat.setting("local_axis")]
    return SyncConfig(hierarchical=strat.setting("hierarchical")).group_size(nodes, local)


def _wires(strat) -> tuple[str, ...]:
    """The wires worth timing on this mesh: the ring only from 3 nodes (at 2 every shift is
    the all_to_all's swap), the integer wire only where its codes fit (4 bits: 2 nodes)."""
    group = _group_size(strat)
    keep = {"scatter_gather": True, "ring": group >= 3}
    keep["allreduce"] = integer.fits(strat.setting("bits"), group)
    return tuple(w for w in WIRES if keep[w])


def _concrete(strat, config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with ``wire="auto"`` replaced by the wire it runs on this mesh."""
    if config.get("wire") != "auto":
        return dict(config)
    sync = SyncConfig(bits=strat.setting("bits"), wire="auto")
    return {**config, "wire": sync.wire_for(_group_size(strat))}


def _default_space(strat) -> dict[str, tuple]:
    local_axis = strat.kwargs.get("local_axis", "local")
    space = {}
    for name in strategy_lib.tunable_settings(strat.algorithm):
        if name == "hierarchical" and strat.mesh.shape[local_axis] == 1:
            continue  # one device per node: both forms run the same program
        if name in strat.kwargs:
            continue  # the user chose it
        space[name] = _wires(strat) if name == "wire" else _VALUES[name]
    return space


def _check_space(strat, space: Mapping[str, Sequence]) -> dict[str, tuple]:
    valid = strategy_lib.valid_kwargs(strat.algorithm)
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
        leaves = [jax.ShapeDtypeStruct((_param_count(params),), np.float32)]
    kept, seen = [], {}
    for value in sorted(space["bucket_bytes"], key=lambda v: v != start["bucket_bytes"]):
        grouping = buckets.make_layout(leaves, bucket_bytes=value, granularity=1).buckets
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


def _worst(values: Sequence[float]) -> np.ndarray:
    """Each entry's maximum over processes (NaN, a failed trial, wins)."""
    local = np.asarray(values, np.float64)
    if jax.process_count() == 1:
        return local
    return np.asarray(multihost_utils.process_allgather(local)).max(axis=0)  # NaN propagates


def _label(config: Mapping[str, Any]) -> str:
    def show(v):
        if isinstance(v, int) and not isinstance(v, bool) and v >= 2**10:
            return f"{v / 2**20:g}MiB" if v >= 2**20 else f"{v / 2**10:g}KiB"
        return str(v)

    return " ".join(f"{k}={show(v)}" for k, v in config.items()) or "(defaults)"


def _param_count(params) -> int:
    return sum(int(np.size(x)) for x in jax.tree.leaves(params))


# Results -----------------------------------------------------------------------------------


class Trial(NamedTuple):
    """One measured configuration.

    Attributes:
      config: the tuned settings of this trial, by ``Strategy`` keyword.
      compile_s: seconds to build and compile the step (the first call minus a median step),
        slowest process; NaN if the trial failed.
      step_s: median seconds per step over the timed steps, slowest process; NaN if failed.
      error: why the trial failed (the exception, as text), or None.
    """

    config: dict[str, Any]
    compile_s: float
    step_s: float
    error: str | None = None


class AutotuneResult(NamedTuple):
    """What ``autotune`` found.

    Attributes:
      config: the fastest configuration (the settings that were tuned).
      strategy: a ``Strategy`` with that configuration and the original's other settings.
      trials: every trial in the order run (empty when the configuration came from the cache).
      start: the configuration the strategy would have run untuned.
      tuning_s: wall seconds ``autotune`` took, compiles included.
      from_cache: whether ``config`` was read from the cache instead of measured.
    """

    config: dict[str, Any]
    strategy: Any
    trials: list[Trial]
    start: dict[str, Any]
    tuning_s: float
    from_cache: bool

    def table(self) -> str:
        """The trials as a Markdown table, fastest first."""
        rows = sorted(self.trials, key=lambda t: (math.isnan(t.step_s), t.step_s))
        lines = [
            "| configuration | step ms | compile s | note |",
            "|---|---:|---:|---|",
        ]
        for t in rows:
            note = []
            if t.config == self.config:
                note.append("chosen")
            if t.config == self.start:
                note.append("start")
            if t.error:
                note.append(f"failed: {t.error}")
            step = "" if math.isnan(t.step_s) else f"{1e3 * t.step_s:.1f}"
            comp = "" if math.isnan(t.compile_s) else f"{t.compile_s:.1f}"
            lines.append(f"| {_label(t.config)} | {step} | {comp} | {', '.join(note)} |")
        return "\n".join(lines)


# The cache ---------------------------------------------------------------------------------


def cache_key(strat, params) -> str:
    """The cache's key for a strategy and model: algorithm, mesh, processes, backend,
    parameter count and the strategy's own settings (those are not tuned)."""
    fixed = ",".join(f"{k}={strat.kwargs[k]!r}" for k in sorted(strat.kwargs))
    mesh = ",".join(f"{k}={v}" for k, v in strat.mesh.shape.items())
    return (
        f"{strat.algorithm} mesh={mesh} processes={jax.process_count()} "
        f"backend={jax.default_backend()} params={_param_count(params)} "
        f"flatten={strat.flatten} {fixed}"
    ).strip()


def _read_cache(path: Path, key: str) -> dict[str, Any] | None:
    try:
        entry = json.loads(path.read_text()).get(key)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        warnings.warn(f"autotune: ignoring unreadable cache {path}: {e}", stacklevel=3)
        return None
    return None if entry is None else entry.get("config")


def _write_cache(path: Path, key: str, result: AutotuneResult) -> None:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    best = min((t.step_s for t in result.trials if t.config == result.config), default=None)
    entries[key] = {
        "config": result.config,
        "step_ms": None if best is None else 1e3 * best,
        "trials": len(result.trials),
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


# The search ---------------------------------------------------------------------------------


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

    Returns:
      An ``AutotuneResult``: ``config``, ``strategy`` (ready to use), ``trials``, ``start``,
      ``tuning_s``, ``from_cache``, and ``table()``.

    Raises:
      ValueError: for async (nothing of it can be tuned without changing its math), a setting
        the algorithm does not take, an empty candidate list, bad counts, or too few batches.

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
    """
    t_start = time.perf_counter()
    if strategy.algorithm == "async":
        raise ValueError(
            "autotune: async has no setting that changes only speed (sync_interval_ms "
            "changes how stale the models are); tune the others, or pick the interval by hand"
        )
    checks.integer(max_trials, "max_trials", "autotune")
    checks.integer(steps_per_trial, "steps_per_trial", "autotune")
    checks.integer(warmup_steps, "warmup_steps", "autotune", minimum=0)
    space = _default_space(strategy) if space is None else _check_space(strategy, space)
    space, start = _with_start(strategy, space)
    space = _distinct_buckets(strategy, params, space, start)
    needed = 1 + warmup_steps + steps_per_trial
    batches = list(itertools.islice(iter(batches), needed))
    if len(batches) < needed:
        raise ValueError(
            f"autotune: needs {needed} batches (1 compiling + {warmup_steps} warm-up + "
            f"{steps_per_trial} timed steps), got {len(batches)}"
        )
    say = print if verbose and jax.process_index() == 0 else (lambda *a, **k: None)
    search = _Search(space, start, max_trials)

    def result(config, trials, from_cache):
        return AutotuneResult(
            config=config,
            strategy=strategy.replace(**config),
            trials=trials,
            start=start,
            tuning_s=time.perf_counter() - t_start,
            from_cache=from_cache,
        )

    path = None if cache is None else Path(cache)
    if path is not None:
        key = cache_key(strategy, params)
        hit = -1
        if jax.process_index() == 0:
            cached = _read_cache(path, key)
            if cached in search.candidates:
                hit = search.candidates.index(cached)
        hit = _agree(hit)
        if hit >= 0:
            say(f"autotune: {_label(search.candidates[hit])} (from {path})")
            return result(search.candidates[hit], [], True)

    if len(search.candidates) == 1:
        return result(start, [], False)
    say(
        f"autotune: {strategy.algorithm}, {len(search.candidates)} configurations, "
        f"{'exhaustive' if search.exhaustive else 'one setting at a time'}, "
        f"at most {max_trials} trials"
    )
    trials = []
    while len(trials) < max_trials:
        index = search.next_index()
        if time_budget_s is not None and time.perf_counter() - t_start > time_budget_s:
            index = -1
        index = _agree(index)
        if index < 0:
            break
        config = search.candidates[index]
        error = None
        try:
            compile_s, step_s = _run_trial(
                strategy, config, loss_fn, optimizer, has_aux, params, batches, warmup_steps,
                dict(model_state=model_state, rng_seed=rng_seed, state_sync=state_sync),
            )  # fmt: skip
        except Exception as e:  # a configuration that cannot run is skipped, not fatal ...
            if config == start:
                raise  # ... but the strategy's own one is the user's step: its error is theirs
            compile_s = step_s = math.nan
            error = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            warnings.warn(f"autotune: skipped {_label(config)}: {error}", stacklevel=2)
        compile_s, step_s = (float(x) for x in _worst([compile_s, step_s]))
        if error is None and math.isnan(step_s):
            error = "failed on another process"
        search.scores[index] = step_s
        trials.append(Trial(config, compile_s, step_s, error))
        say(
            f"autotune {len(trials):2d}: {_label(config)}: "
            + (f"failed ({error})" if error else f"{1e3 * step_s:.1f} ms/step, "
               f"compile {compile_s:.1f} s")
        )  # fmt: skip
    measured = search.best()  # None: no trial ran within the time budget
    best = measured or start
    found = result(best, trials, False)
    if path is not None and jax.process_index() == 0 and measured is not None:
        _write_cache(path, key, found)
    say(f"autotune: chose {_label(best)} in {found.tuning_s:.1f} s")
    return found
