"""Divergence made visible: a loss watch on every train step, and an opt-in non-finite guard.

``watch_loss`` is what ``TrainStep.step`` calls with each step's metrics. It reads a step's loss
only once the step has finished (``jax.Array.is_ready``), so it never makes the host wait on
the device; a loss still in flight is read at a later call. The first non-finite loss, or one
above ``DIVERGENCE_FACTOR`` times the largest of the first ``REFERENCE_STEPS`` losses (both in
magnitude), gets one ``DivergenceWarning`` per step object, naming the algorithm, the likely
cause and what to change. ``TrainStep.on_divergence`` set to ``"raise"`` raises
``FloatingPointError`` instead, ``"ignore"`` turns the watch off.

``skip_nonfinite(tx)`` wraps any optax transformation, as mixed-precision loss scaling does:
an update with a non-finite value is replaced by zeros and the wrapped state is left as it
was, and the state counts the skipped steps. It decides from the transformation's output
updates, which the data-parallel algorithms make identical on every replica (the synced
gradient's Adam step, or QAdam's step from the decoded momentum), so every replica skips the
same steps and the replicas stay identical.
"""

import math
import warnings
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

# A loss this many times the early steps' largest is taken for divergence.
DIVERGENCE_FACTOR = 100.0
# The steps whose largest loss is the reference.
REFERENCE_STEPS = 10
ON_DIVERGENCE = ("warn", "raise", "ignore")

_ADVICE = {
    "qadam": (
        "QAdam's step is m / sqrt(v): with second_moment='frozen' (Bagua's rule) v stops at "
        "the end of the warm-up, and weights whose gradients grow later take huge steps. Use "
        "the default second_moment (None: 'gradient' at 8 bits, 'momentum' at 4), or a longer "
        "warmup_steps, a larger eps or a lower learning_rate; skip_nonfinite=True skips "
        "non-finite updates"
    ),
    "bytegrad": (
        "lower the learning rate; with bits=4 add error_feedback=True or use bits=8; "
        "wrap the optimizer in jax_bytegrad.skip_nonfinite(...) to skip non-finite updates"
    ),
}
_DEFAULT_ADVICE = (
    "lower the learning rate, or wrap the optimizer in jax_bytegrad.skip_nonfinite(...) to "
    "skip non-finite updates"
)


class DivergenceWarning(RuntimeWarning):
    """A train step's loss became non-finite or grew far above its first steps' losses."""


class _Watch:
    def __init__(self):
        self.pending: list[tuple[int, Any]] = []
        self.seen = 0
        self.reference = -math.inf
        self.reported = False


_WATCHES: "weakref.WeakKeyDictionary[Any, _Watch]" = weakref.WeakKeyDictionary()


def _scalar(loss):
    """This process's copy of a replicated loss, or None for something else."""
    if isinstance(loss, jax.Array):
        if loss.size != 1 or not loss.is_fully_replicated:
            return None
        return loss.addressable_shards[0].data
    return loss if isinstance(loss, (float, int, np.floating, np.ndarray)) else None


def _message(algorithm: str, step: int, loss: float, reference: float) -> str:
    what = (
        f"became {loss}"
        if not math.isfinite(loss)
        else f"reached {loss:.4g}, over {DIVERGENCE_FACTOR:g}x the largest of the first "
        f"{REFERENCE_STEPS} steps' ({reference:.4g})"
    )
    advice = _ADVICE.get(algorithm, _DEFAULT_ADVICE)
    return f"{algorithm}: the training loss {what} at step {step}; it is diverging. {advice}."


def _check(step_obj, watch: _Watch, step: int, loss: float) -> None:
    if watch.reported:
        return
    if step <= REFERENCE_STEPS and math.isfinite(loss):
        watch.reference = max(watch.reference, abs(loss))
    # Magnitudes, so that a loss that may be negative (a log-likelihood bound) compares too.
    bad = not math.isfinite(loss) or (
        step > REFERENCE_STEPS
        and watch.reference > 0
        and abs(loss) > DIVERGENCE_FACTOR * watch.reference
    )
    if not bad:
        return
    watch.reported = True
    message = _message(step_obj.algorithm, step, loss, watch.reference)
    if getattr(step_obj, "on_divergence", "warn") == "raise":
        raise FloatingPointError(message)
    warnings.warn(message, DivergenceWarning, stacklevel=4)


def watch_loss(step_obj, outputs):
    """Looks at the losses of finished steps of ``step_obj``; returns ``outputs`` as it is.

    ``outputs`` is a step's ``(state, metrics)``. Its loss is queued, and every queued loss
    whose step has finished is checked, oldest first; nothing waits on the device.

    Raises:
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
    watch = _WATCHES.get(step_obj)
    if watch is None:
        watch = _WATCHES[step_obj] = _Watch()
    if watch.reported:
        return outputs
    watch.seen += 1
    watch.pending.append((watch.seen, loss))
    while watch.pending:
        number, value = watch.pending[0]
        if isinstance(value, jax.Array) and not value.is_ready():
            break
        watch.pending.pop(0)
        _check(step_obj, watch, number, float(np.asarray(value)))
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
      An ``optax.GradientTransformation`` whose state is a ``SkipNonFiniteState``;
      ``state.skipped`` counts the skipped updates.

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

    def init_fn(params):
        return SkipNonFiniteState(inner.init(params), jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, **extra):
        new_updates, new_inner = inner.update(updates, state.inner_state, params, **extra)
        ok = _all_finite(new_updates)
        new_updates = jax.tree.map(lambda u: jnp.where(ok, u, jnp.zeros_like(u)), new_updates)
        new_inner = jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_inner, state.inner_state)
        skipped = state.skipped + jnp.where(ok, 0, 1).astype(jnp.int32)
        return new_updates, SkipNonFiniteState(new_inner, skipped)

    return optax.GradientTransformation(init_fn, update_fn)


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
