"""A Flax NNX model trained by any strategy, in the shape of ``nnx.Optimizer``.

Follows Flax NNX's own training loop (``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and an
``@nnx.jit`` step that calls ``optimizer.update``; the Flax NNX basics guide), so that an NNX
script moves onto a ``Strategy`` by replacing its optimizer and its step function:

    step = jax_bytegrad.nnx.train_step(strategy, model, optax.adamw(1e-3), loss_fn)
    for batch in batches:
        metrics = step(batch)        # trains, then writes the model back, as update does

``loss_fn(model, batch)`` is the script's own. The model is split as ``nnx.split(model,
nnx.Param, nnx.RngState, ...)``: the parameters are trained; the rest but the RNG streams
(``nnx.BatchStat`` and any other variable) is the step's model state, synced over the mesh
after each step (``state_sync``); the RNG streams (``nnx.Dropout``'s) are reseeded inside every
step from the key ``TrainStep.device_key`` gives, per device and per step, so every device
drops different units and a restart from a checkpoint drops the same ones again.
"""

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from jax_bytegrad._src.steps.base import StepState, TrainStep


def _copy(state):
    """A copy of an ``nnx.State`` whose variables are new objects (made in the caller's trace,
    so they may be written there)."""
    return jax.tree.map(lambda x: x, state)


def _filled(template, pure):
    state = _copy(template)
    nnx.replace_by_pure_dict(state, pure)
    return state


def _stream_tags(model) -> tuple[str, ...]:
    tags = {s.key.tag for _, s in nnx.iter_graph(model) if isinstance(s, nnx.RngStream)}
    return tuple(sorted(tags))


class NNXTrainStep:
    """A train step bound to one NNX model: ``metrics = step(batch)`` trains it in place.

    Attributes:
      model: the NNX model; after every step it holds the trained parameters and the synced
        model state (for the decentralized pair, the mean over devices).
      train_step: the underlying ``TrainStep`` (``phase_counts``, ``lower`` take
        ``step.state`` and a batch; ``communication_stats``, ``memory_stats`` and
        ``device_key`` are also this step's own, on its state).
      state: the ``StepState``: checkpoint it as it is, and assign a restored one back
        (``step.state = restored``), which also writes the model. Restore onto
        ``state_shapes()``, which carries the shardings the step keeps its state in.
    """

    def __init__(self, model, train_step: TrainStep, graphdef, templates, has_state: bool):
        self.model = model
        self.train_step = train_step
        self._graphdef, self._templates, self._has_state = graphdef, templates, has_state
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        self._state = train_step.init(params)
        # The state init made, not yet fitted to the loss on a batch (``TrainStep.init``'s
        # ``batch``): the first batch the step sees fits it.
        self._fresh = True

    @property
    def state(self) -> StepState:
        return self._state

    @state.setter
    def state(self, state: StepState) -> None:
        self._state, self._fresh = state, False
        self._write_back()

    def _fit(self, batch) -> StepState:
        if self._fresh:
            self._state, self._fresh = self.train_step._fit_state(self._state, batch, False), False
        return self._state

    def _write_back(self) -> None:
        params = _filled(self._templates[0], self.train_step.params(self._state))
        states = [params]
        if self._has_state:
            states.append(_filled(self._templates[1], self._state.model_state))
        nnx.update(self.model, *states)

    def __call__(self, batch) -> dict[str, Any]:
        """One step on ``batch`` (this process's rows of the global batch); returns the
        metrics (``{"loss": ...}``, plus ``"aux"`` with ``has_aux``), means over devices."""
        self._state, metrics = self.train_step(self._fit(batch), batch)
        self._write_back()
        return metrics

    def state_shapes(self, batch=None) -> StepState:
        """The ``StepState`` this step starts from, as ``jax.ShapeDtypeStruct`` leaves with the
        shardings the step keeps it in (``TrainStep.state_shapes``): the target to restore a
        checkpoint onto, with any ``shard=``. ``batch``: a batch (or its shapes), for a
        ``shard="params"`` model marked with ``exchange_in_loop`` whose sync keeps error
        feedback (``TrainStep.init``)."""
        return self.train_step.state_shapes(nnx.to_pure_dict(self._templates[0]), batch)

    def communication_stats(self, batch):
        """Bytes each device sends per step, by phase (see ``TrainStep``)."""
        return self.train_step.communication_stats(self._fit(batch), batch)

    def memory_stats(self, batch):
        """Memory one device needs for a step, by phase (``TrainStep.memory_stats``)."""
        return self.train_step.memory_stats(self._fit(batch), batch)

    def device_key(self, device: int) -> jax.Array:
        """The PRNG key device ``device`` reseeds the model's Dropout streams with in the next
        step (``TrainStep.device_key``); needs ``rng_seed=``."""
        return self.train_step.device_key(self._state, device)

    def close(self) -> None:
        self.train_step.close()

    def __enter__(self) -> "NNXTrainStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def train_step(
    strategy,
    model: nnx.Module,
    optimizer: optax.GradientTransformation | None,
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    state_sync: str = "mean",
    rng_seed: int = 0,
) -> NNXTrainStep:
    """Builds a train step of ``strategy`` for a Flax NNX model, trained in place.

    It stands where ``nnx.Optimizer(model, optimizer, wrt=nnx.Param)`` and an ``@nnx.jit``
    step stood: ``step(batch)`` computes ``loss_fn(model, batch)`` on each device's rows,
    syncs as the strategy's algorithm does, applies ``optimizer`` to the ``nnx.Param``
    variables and writes the new parameters and model state back into ``model`` (as
    ``optimizer.update`` does). BatchNorm statistics and other non-parameter variables are
    carried as model state, synced with ``state_sync``; each ``nnx.Dropout`` (each RNG stream)
    gets a key of its own per device and per step, derived from ``rng_seed``.

    Args:
      strategy: a ``jax_bytegrad.Strategy`` (``gradient_allreduce``, ``bytegrad``,
        ``qadam``, ``decentralized``, ``low_precision_decentralized``).
      model: the NNX model, in training mode (``model.train()``).
      optimizer: the optax optimizer, e.g. ``optax.adamw(1e-3)``; None for ``qadam``.
      loss_fn: ``loss_fn(model, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      state_sync: ``"mean"`` (BatchNorm statistics averaged over the mesh, as cross-replica
        BatchNorm) or ``"first"`` (device 0's, as DDP's ``broadcast_buffers``).
      rng_seed: the seed of the per-device, per-step keys of the model's RNG streams.

    Returns:
      An ``NNXTrainStep``: ``metrics = step(batch)``; ``step.state`` to checkpoint or
      restore; ``step.train_step`` for ``communication_stats``; ``step.close()``.

    Raises:
      ValueError: for a model that is not an ``nnx.Module``, parameters that are not
        floating point, or what ``Strategy.train_step`` refuses.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jax_bytegrad
      >>> from flax import nnx
      >>> model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
      >>> strategy = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(1, 1))
      >>> loss_fn = lambda model, x: jnp.mean(model(x) ** 2)
      >>> step = jax_bytegrad.nnx.train_step(strategy, model, optax.sgd(0.1), loss_fn)
      >>> metrics = step(np.ones((8, 4), np.float32))
      >>> int(step.state.step), metrics["loss"].shape
      (1, ())

    References:
      The Flax NNX basics guide: https://flax.readthedocs.io/en/latest/nnx_basics.html
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(
            f"jax_bytegrad.nnx.train_step: model must be a flax.nnx.Module, got "
            f"{type(model).__name__}; for a pytree of params use strategy.train_step"
        )
    graphdef, params, rngs, rest = nnx.split(model, nnx.Param, nnx.RngState, ...)
    tags = _stream_tags(model)
    has_state = bool(jax.tree.leaves(rest))

    def loss(params_dict, batch, *, model_state=None, key=None):
        states = [_filled(params, params_dict), _copy(rngs)]
        states += [_filled(rest, model_state)] if has_state else [_copy(rest)]
        local = nnx.merge(graphdef, *states)
        if tags:
            # A stream of blocks built under nnx.vmap (nnx.split_rngs) holds a key per block:
            # "match_shape" splits the device's key into as many.
            keys = {t: jax.random.fold_in(key, i) for i, t in enumerate(tags)}
            nnx.reseed(local, policy="match_shape", **keys)
        out = loss_fn(local, batch)
        if not has_state:
            return out
        return out, nnx.to_pure_dict(nnx.state(local, nnx.Not(nnx.Any(nnx.Param, nnx.RngState))))

    step = strategy.train_step(
        loss,
        optimizer,
        has_aux=has_aux,
        model_state=nnx.to_pure_dict(rest) if has_state else None,
        rng_seed=rng_seed if tags else None,
        state_sync=state_sync,
    )
    return NNXTrainStep(model, step, graphdef, (params, rest), has_state)
