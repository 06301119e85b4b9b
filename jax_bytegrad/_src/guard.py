"""Divergence made visible: a loss watch on every train step, and an opt-in non-finite guard.

``watch_loss`` is what ``TrainStep.step`` calls with each step's ``(new state, metrics)``. It
reads a step's loss only once the step has finished (``jax.Array.is_ready``), so it never makes
the host wait on the device; a loss still in flight is read at a later call, and its report
names the step it belongs to. ``TrainStep.on_divergence`` set to ``"raise"`` raises
``FloatingPointError`` instead of warning, ``"ignore"`` turns the watch off. It reports, each
as a ``DivergenceWarning`` that names the algorithm:

- a non-finite loss, or one above ``DIVERGENCE_FACTOR`` times the largest of the first
  ``REFERENCE_STEPS`` losses (both in magnitude), once per step object, with its likely cause:
  a loss that was finite and not growing (the last finite loss no more than
  ``GROWTH_FACTOR`` times the largest before it) and becomes NaN or inf at once points at the
  batch; one that grew first points at the learning rate and the algorithm's settings;
- with ``skip_nonfinite`` in the optimizer, a skipped step: at the 1st, 2nd, 4th, 8th, ...
  skip, with the count so far and what the step's loss says of the cause. The step is handled
  (the params and the optimizer state stay as they were), so this warns even with
  ``"raise"``; ``STALL_STEPS`` skips in a row mean training has stopped, reported as
  divergence.

Reports name a step by the state's count (``StepState.step``, on the host), so a run restored
from a checkpoint names its steps as the first run did; its first step's skip, if any, goes
unreported (the count before it is the restored state's, which the watch never sees).

The skipped count lives in the new state, which the next step donates (deletes): so that it
can be read once ready, the watch copies it on the device as soon as it is given the state
(one small asynchronous copy per step, only for an optimizer with ``skip_nonfinite``).

``skip_nonfinite(tx)`` wraps any optax transformation, as mixed-precision loss scaling does:
an update with a non-finite value is replaced by zeros and the wrapped state is left as it
was, and the state counts the skipped steps. It decides from the transformation's output
updates, which the data-parallel algorithms make identical on every replica (the synced
gradient's Adam step, or QAdam's step from the decoded momentum), so every replica skips the
same steps and the replicas stay identical. ``optax.apply_if_finite`` does the same job with
three differences that rule it out here: it decides from its input updates, which for
``qadam`` are each device's own gradients (a NaN on one device would make that device alone
skip, and the replicas part); it runs the inner update inside a ``lax.cond``, where QAdam's
collectives would then sit (the steps keep collectives out of conditionals); and after
``max_consecutive_errors`` non-finite updates in a row it applies one, which turns every
parameter to NaN. What serves is shared: the count saturates through ``optax.safe_increment``.
"""

import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_bytegrad._src.sync import shards

# A loss this many times the early steps' largest is taken for divergence.
DIVERGENCE_FACTOR = 100.0
# The steps whose largest loss is the reference.
REFERENCE_STEPS = 10
# A loss that turns non-finite after one at most this many times the largest before it did not
# grow: the batch is the likely cause.
GROWTH_FACTOR = 2.0
# Skipped steps in a row that mean training has stopped.
STALL_STEPS = 10
ON_DIVERGENCE = ("warn", "raise", "ignore")

_ADVICE = {
    "qadam": (
        "QAdam's step is m / sqrt(v): with second_moment='frozen' (Bagua's rule) v stops at "
        "the end of the warm-up, and weights whose gradients grow later take huge steps. Use "
        "the default second_moment (None: 'gradient' at 8 bits, 'momentum' at 4), or a longer "
        "warmup_steps, a larger eps or a lower learning_rate"
    ),
    "bytegrad": "lower the learning rate; with bits=4 add error_feedback=True or use bits=8",
}
_DEFAULT_ADVICE = "lower the learning rate"
# How to add the guard, where it is missing.
_GUARD = {
    "qadam": "pass skip_nonfinite=True to Strategy('qadam', ...) (or wrap it: "
    "jax_bytegrad.skip_nonfinite(qadam(...)))"
}
_DEFAULT_GUARD = "wrap the optimizer in jax_bytegrad.skip_nonfinite(...)"


class DivergenceWarning(RuntimeWarning):
    """A train step's loss became non-finite or grew far above its first steps' losses, or
    ``skip_nonfinite`` skipped a step."""


class Watch:
    """What ``watch_loss`` keeps of one train step's losses: each step object holds its own
    (``TrainStep.loss_watch``)."""

    def __init__(self):
        self.pending: list[tuple[int, int, Any, list | None]] = []
        self.seen = 0
        self.reference = -math.inf  # the largest |loss| of the first REFERENCE_STEPS
        self.last: tuple[int, float] | None = None  # the last finite loss of a step applied
        self.peak = -math.inf  # the largest |loss| of the steps applied before that one
        self.skipped: int | None = None  # the count as of the last step read
        self.in_a_row = 0
        self.next_report = 1
        self.guards: tuple | None = None  # (treedef, indices) of the SkipNonFiniteStates
        self.reported = False


def _scalar(loss):
    """This process's copy of a replicated loss, or None for something else."""
    if isinstance(loss, jax.Array):
        if loss.size != 1 or not loss.is_fully_replicated:
            return None
        return loss.addressable_shards[0].data
    return loss if isinstance(loss, (float, int, np.floating, np.ndarray)) else None


def _is_guard(x) -> bool:
    return isinstance(x, SkipNonFiniteState)


def _guard_states(watch: Watch, state) -> list:
    """The ``SkipNonFiniteState``s in ``state``: searched for once per step object, then cut
    out of each new state at the same places (a flatten in C++, no Python per leaf)."""
    if watch.guards is not None:
        treedef, indices = watch.guards
        if not indices:
            return []
        try:
            parts = treedef.flatten_up_to(state)
            return [parts[i] for i in indices]
        except (ValueError, TypeError):  # a state of another layout: search again
            pass
    parts, treedef = jax.tree.flatten(state, is_leaf=_is_guard)
    watch.guards = treedef, [i for i, x in enumerate(parts) if _is_guard(x)]
    return [parts[i] for i in watch.guards[1]]


def _skip_counts(watch: Watch, state) -> list | None:
    """Device copies of the skipped counts in ``state``, None without ``skip_nonfinite``:
    enqueued, never waited for, because the next step donates ``state`` (deletes its arrays)."""
    return [jnp.copy(guard.skipped) for guard in _guard_states(watch, state)] or None


def _ready(value) -> bool:
    return not isinstance(value, jax.Array) or value.is_ready()


def _cause(watch: Watch, loss: float) -> tuple[str, str]:
    """What a non-finite ``loss`` after the steps seen so far says of its cause: ``("first"
    | "batch" | "growth", a sentence)``."""
    if watch.last is None:
        return "first", (
            "from the first step: check the initial params, the loss function and the first batch"
        )
    step, last = watch.last
    if watch.peak == -math.inf or abs(last) <= GROWTH_FACTOR * watch.peak:
        return "batch", (
            f"at once, after finite losses that were not growing ({last:.4g} at step {step}): "
            "a batch holding a NaN or inf is the likely cause; check the batches (np.isfinite)"
        )
    return "growth", (
        f"after growing ({last:.4g} at step {step}, over {GROWTH_FACTOR:g}x the largest before it)"
    )


def _advice(algorithm: str, guarded: bool) -> str:
    """What to change against a growing loss, and the guard where it is missing."""
    advice = _ADVICE.get(algorithm, _DEFAULT_ADVICE)
    advice = advice[0].upper() + advice[1:]
    if guarded:
        return advice
    return f"{advice}; to skip non-finite updates, {_GUARD.get(algorithm, _DEFAULT_GUARD)}"


def _report(step_obj, watch: Watch, message: str, *, divergence: bool) -> None:
    if divergence:
        watch.reported = True
        if getattr(step_obj, "on_divergence", "warn") == "raise":
            raise FloatingPointError(message)
    # Attributed to the user's call of the step: _report <- _check <- watch_loss <- step.
    warnings.warn(message, DivergenceWarning, stacklevel=5)


def _message(algorithm: str, step: int, loss: float, reference: float) -> str:
    """The report of a finite loss far above the first steps' (a growing divergence)."""
    return (
        f"{algorithm}: the training loss reached {loss:.4g} at step {step}, over "
        f"{DIVERGENCE_FACTOR:g}x the largest of the first {REFERENCE_STEPS} steps' "
        f"({reference:.4g}); it is diverging. {_advice(algorithm, False)}."
    )


def _nonfinite_message(algorithm: str, watch: Watch, step: int, loss: float, guarded) -> str:
    """The report of a non-finite loss on a step that was not skipped."""
    kind, cause = _cause(watch, loss)
    if kind == "growth":
        advice = f"It is diverging. {_advice(algorithm, guarded)}"
    elif guarded:
        advice = "skip_nonfinite did not skip it: its update was finite"
    else:
        # The mean carries one device's NaN to every replica.
        advice = (
            "Its update has most likely made the params non-finite on every replica: restore "
            f"the last checkpoint. To skip such steps, {_GUARD.get(algorithm, _DEFAULT_GUARD)}"
        )
    return f"{algorithm}: the training loss became {loss} at step {step} {cause}. {advice}."


def _skip_message(algorithm: str, watch: Watch, step: int, loss: float) -> str:
    """The report of a step that ``skip_nonfinite`` skipped."""
    if math.isfinite(loss):
        why = (
            f"its loss was finite ({loss:.4g}), so the gradient or the update overflowed: clip "
            "the gradients (optax.clip_by_global_norm) or lower the learning rate"
        )
    else:
        kind, cause = _cause(watch, loss)
        why = f"its loss became {loss} {cause}"
        why += f"; {_advice(algorithm, True)}" if kind == "growth" else ""
    # The decentralized pair skip per device (the count is the largest over the devices).
    where = " on the devices that had one" if "decentralized" in algorithm else ""
    return (
        f"{algorithm}: skip_nonfinite skipped step {step}: its update had a NaN or inf, so the "
        f"params and the optimizer state stayed as they were{where} ({watch.skipped} of {step} "
        f"steps skipped so far; reported again at {2 * watch.skipped} skipped). "
        f"{why[0].upper()}{why[1:]}."
    )


def _stall_message(algorithm: str, watch: Watch, step: int) -> str:
    """The report of ``STALL_STEPS`` skipped steps in a row."""
    return (
        f"{algorithm}: skip_nonfinite skipped the last {watch.in_a_row} steps in a row (to "
        f"step {step}; {watch.skipped} of {step} in all), so training has stopped. One bad "
        "batch is skipped once; every step skipped means the loss or its gradient is "
        "non-finite at the current params, or all the data is bad. "
        f"{_advice(algorithm, True)}."
    )


def _check(step_obj, watch: Watch, number: int, step: int, loss: float, skipped) -> None:
    """Reports what one finished step's loss (and skipped count) says, if anything.

    ``number`` counts the steps this watch has seen, ``step`` the state's steps (they differ
    after a restore), ``skipped`` is the guard's count after the step (None without one).
    """
    algorithm, guarded = step_obj.algorithm, skipped is not None
    if guarded and watch.skipped is None:
        # A state restored mid-run brings its count; its first step here is taken as applied.
        watch.skipped = 0 if step == number else skipped
    if guarded and skipped > watch.skipped:
        watch.skipped, watch.in_a_row = skipped, watch.in_a_row + 1
        if watch.in_a_row == STALL_STEPS:
            _report(step_obj, watch, _stall_message(algorithm, watch, step), divergence=True)
        elif watch.skipped >= watch.next_report:
            watch.next_report = 2 * watch.skipped
            message = _skip_message(algorithm, watch, step, loss)
            _report(step_obj, watch, message, divergence=False)
        return  # the params did not move: this loss says nothing of the training's course
    watch.in_a_row = 0
    if not math.isfinite(loss):
        message = _nonfinite_message(algorithm, watch, step, loss, guarded)
        _report(step_obj, watch, message, divergence=True)
        return
    if number <= REFERENCE_STEPS:
        watch.reference = max(watch.reference, abs(loss))
    # Magnitudes, so that a loss that may be negative (a log-likelihood bound) compares too.
    if (
        number > REFERENCE_STEPS
        and watch.reference > 0
        and abs(loss) > DIVERGENCE_FACTOR * watch.reference
    ):
        _report(step_obj, watch, _message(algorithm, step, loss, watch.reference), divergence=True)
        return
    if watch.last is not None:
        watch.peak = max(watch.peak, abs(watch.last[1]))
    watch.last = (step, loss)


def watch_loss(step_obj, outputs):
    """Looks at the losses of finished steps of ``step_obj``; returns ``outputs`` as it is.

    ``outputs`` is a step's ``(new state, metrics)``, given right after the step is
    dispatched and before the next one is (which donates the state). Its loss, and where the
    optimizer has ``skip_nonfinite`` a device copy of the skipped count, are queued; every
    queued step whose values are ready is checked, oldest first; nothing waits on the device.

    Raises:
      ValueError: when ``step_obj.on_divergence`` is not one of ``ON_DIVERGENCE``.
      FloatingPointError: on divergence, when ``step_obj.on_divergence == "raise"``.
    """
    mode = getattr(step_obj, "on_divergence", "warn")
    if mode not in ON_DIVERGENCE:
        raise ValueError(
            f"{step_obj.algorithm}: on_divergence={mode!r}; use one of "
            f"{', '.join(map(repr, ON_DIVERGENCE))}"
        )
    metrics = outputs[1]
    loss = _scalar(metrics.get("loss")) if isinstance(metrics, dict) else None
    if mode == "ignore" or loss is None:
        return outputs
    watch = step_obj.loss_watch
    if watch.reported:
        return outputs
    watch.seen += 1
    state = outputs[0]
    # The state's own count (host side: reading it waits for nothing) names the step.
    step = getattr(state, "step", None)
    step = int(step) if isinstance(step, (np.ndarray, np.integer, int)) else watch.seen
    watch.pending.append((watch.seen, step, loss, _skip_counts(watch, state)))
    while watch.pending and not watch.reported:
        number, step, value, counts = watch.pending[0]
        if not (_ready(value) and all(map(_ready, counts or ()))):
            break
        watch.pending.pop(0)
        skipped = None if counts is None else sum(_largest(c) for c in counts)
        _check(step_obj, watch, number, step, float(np.asarray(value)), skipped)
    return outputs


class SkipNonFiniteState(NamedTuple):
    """State of ``skip_nonfinite``.

    Attributes:
      inner_state: the wrapped transformation's state, as of its last applied update.
      skipped: int32 scalar, how many updates had a non-finite value and were skipped.
    """

    inner_state: Any
    skipped: jax.Array


def _all_finite(tree) -> jax.Array:
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Skips every update of ``inner`` that has a non-finite value, and counts them.

    As mixed-precision loss scaling does: on such a step the update is zeros (params stay as
    they are) and ``inner``'s state is left as it was, so a NaN or inf gradient (or momentum)
    does not reach the params or the optimizer's moments. The decision is taken on
    ``inner``'s output updates: put the wrapper around the part of the chain whose output is
    the same on every replica (all of ``qadam(...)``, or the optimizer after ``bytegrad()``),
    and every replica skips the same steps.

    Args:
      inner: the transformation to guard, e.g. ``optax.adam(1e-3)`` or ``qadam(...)``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is a ``SkipNonFiniteState``;
      ``state.skipped`` counts the skipped updates. Its ``update`` passes extra arguments on
      to ``inner``; with a sharded step's (``sharded``), the devices of a node decide
      together from their blocks of the update.

    Raises:
      ValueError: when ``inner`` is not an optax transformation.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> tx = jax_bytegrad.skip_nonfinite(optax.adam(1e-2))
      >>> state = tx.init(jnp.ones(2))
      >>> updates, state = tx.update(jnp.array([jnp.nan, 1.0]), state, jnp.ones(2))
      >>> updates.tolist(), int(state.skipped)
      ([0.0, 0.0], 1)
    """
    if not isinstance(inner, optax.GradientTransformation):
        raise ValueError(
            f"skip_nonfinite: expected an optax.GradientTransformation such as "
            f"optax.adam(1e-3), got {inner!r}"
        )

    inner = optax.with_extra_args_support(inner)

    def init_fn(params):
        return SkipNonFiniteState(inner.init(params), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, **extra):
        new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra)
        # In a sharded step each device holds its blocks: the node's devices decide together.
        ok = shards.layout_of(extra.get("sharded")).all_agree(_all_finite, new_updates)
        new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
        new_inner = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_inner, state.inner_state)
        skipped = jnp.where(ok, state.skipped, optax.safe_increment(state.skipped))
        return new_updates, SkipNonFiniteState(new_inner, skipped)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def skipped_steps(opt_state) -> int:
    """The number of updates ``skip_nonfinite`` skipped, found anywhere in ``opt_state``.

    Args:
      opt_state: an optimizer state (or a train state) holding one ``SkipNonFiniteState``.

    Returns:
      The skipped count, 0 when no ``SkipNonFiniteState`` is in it. Where the count differs
      between devices (decentralized steps, where each device skips on its own), the largest.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> tx = jax_bytegrad.skip_nonfinite(optax.sgd(0.1))
      >>> jax_bytegrad.skipped_steps(tx.init(jnp.ones(2)))
      0
    """
    found = [
        x.skipped
        for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, SkipNonFiniteState))
        if isinstance(x, SkipNonFiniteState)
    ]
    return sum(_largest(count) for count in found)


def _largest(count) -> int:
    """The largest of a count that may differ between devices (a decentralized step keeps one
    per device), over this process's copies."""
    if isinstance(count, jax.Array):
        return max(int(np.max(np.asarray(s.data))) for s in count.addressable_shards)
    return int(np.max(np.asarray(count)))
