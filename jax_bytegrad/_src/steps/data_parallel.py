"""A data-parallel train step around any optax optimizer over a ("node", "local") mesh.

Follows Bagua's data-parallel model (Gan et al., "Bagua: Scaling up Distributed Learning with
System Relaxations", VLDB 2022): parameters and optimizer state are replicated, each device
computes the gradient of its slice of the batch, and the optimizer's first transformation
(``bytegrad``, ``gradient_allreduce``, ``qadam``) averages what must be averaged.
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks
from jax_bytegrad._src.sharding import StateSpecs
from jax_bytegrad._src.steps.base import (
    TrainState,
    TrainStep,
    count,
    global_batch,
)
from jax_bytegrad._src.steps.model_state import ModelState, StateSync


def _unsynced(updates, opt_state, specs, axes) -> list[str]:
    """Paths of updates, or replicated state, that still differ between devices."""
    shared = [True] * len(jax.tree.leaves(updates))
    shared += [spec == P() for spec in jax.tree.leaves(specs)]
    leaves = jax.tree.leaves_with_path((updates, opt_state))
    return [
        jax.tree_util.keystr(path)
        for (path, leaf), replicated in zip(leaves, shared, strict=True)
        if replicated and checks.varying_axes(leaf) & set(axes)
    ]


def traced_gradient(grad_fn, params, *args):
    """``grad_fn(params, *args)`` (whose result ends with the gradient), traced once, and the
    params' leaf indices in the order its backward pass produces their gradients (ties: last
    leaf first), read from that trace.

    The sync of each bucket of the gradient runs in this order (``buckets.ready_order``), so
    that the first bucket to cross between nodes is the first one complete.
    """
    closed, shape = jax.make_jaxpr(grad_fn, return_shape=True)(params, *args)
    out = jax.extend.core.jaxpr_as_fun(closed)(*jax.tree.leaves((params, args)))
    produced = {}
    for index, equation in enumerate(closed.jaxpr.eqns):
        for var in equation.outvars:
            produced[id(var)] = index
    leaves = len(jax.tree.leaves(params))
    ranks = [produced.get(id(var), -1) for var in closed.jaxpr.outvars[-leaves:]]
    order = tuple(sorted(range(leaves), key=lambda i: (ranks[i], -i)))
    return jax.tree.unflatten(jax.tree.structure(shape), out), order


class DataParallelStep(TrainStep):
    """The ``TrainStep`` of ``data_parallel_step``: one program per optimizer phase."""

    def __init__(self, loss_fn, optimizers, phase_of, mesh, *, has_aux, donate, axes, flatten,
                 model=None):  # fmt: skip
        super().__init__(
            "data_parallel_step", mesh, loss_fn, axes=axes, has_aux=has_aux, flatten=flatten,
            donate=donate, model=model,
        )  # fmt: skip
        self._optimizers = dict(optimizers)
        self._phase_of = phase_of
        self.phases = tuple(self._optimizers)
        self._state_specs = StateSpecs(self._axes)

    def _phase(self, steps_taken: int) -> tuple[str, Any]:
        name = self._phase_of(steps_taken)
        if name not in self._optimizers:
            raise ValueError(
                f"{self.algorithm}: phase_of({steps_taken}) gave {name!r}, which is not one of "
                f"the optimizers' phases {self.phases}"
            )
        return name, name

    def _shardings(self, specs):
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs)

    def _abstract_opt_state(self, params):
        return jax.eval_shape(next(iter(self._optimizers.values())).init, params)

    def _optimizer_init(self):
        return next(iter(self._optimizers.values())).init

    def per_device(self, phase: str | None = None) -> Callable:
        """The un-jitted, un-mapped step of one device, for a ``shard_map`` of your own:
        ``(params, opt_state, batch) -> (params, opt_state, loss[, aux])``.

        ``loss`` (and ``aux``) are means over every device. ``phase`` picks the optimizer of
        a step with several; None for the only one. A step built with ``model_state=``
        or ``rng_seed=`` takes ``(params, opt_state, *model_inputs, batch)``, the model
        inputs being ``state.model_state``, then ``state.rng`` and the step count as uint32,
        and returns the synced model state last.
        """
        optimizer = optax.with_extra_args_support(
            self._optimizers[phase if phase is not None else self.phases[0]]
        )
        axes, has_aux, model = self._axes, self.has_aux, self.model
        grad_fn = model.value_and_grad(self.loss_fn, has_aux, axes)

        def step(params, opt_state, *rest):
            *model_inputs, batch = rest
            # Varying params: jax.grad of a replicated value would come back already summed
            # over the devices, through a hidden float32 all-reduce.
            varying = jax.lax.pcast(params, axes, to="varying")
            traced, order = traced_gradient(grad_fn, varying, batch, *model_inputs)
            (loss, aux, model_state), grads = traced
            updates, opt_state = optimizer.update(grads, opt_state, params, gradient_order=order)
            unsynced = _unsynced(updates, opt_state, self._state_specs(opt_state), axes)
            if unsynced:
                raise ValueError(
                    "data_parallel_step: the optimizer leaves updates or state that differ "
                    f"between devices ({', '.join(unsynced[:3])}); put jax_bytegrad.bytegrad() "
                    "or gradient_allreduce() first in the optax chain, or use "
                    "jax_bytegrad.qadam()"
                )
            params = optax.apply_updates(params, updates)
            out = (params, opt_state, jax.lax.pmean(loss, axes))
            out += (jax.lax.pmean(aux, axes),) if has_aux else ()
            return out + ((model_state,) if model.has_state else ())

        return step

    def sharded(self, opt_state, phase: str | None = None) -> Callable:
        """The step as one ``jax.shard_map`` over the mesh, not jitted: call it inside a
        ``jax.jit`` of your own. ``opt_state`` (or its ``jax.eval_shape``) gives the specs."""
        specs = self._state_specs(opt_state)
        model_specs = (P(),) * self.model.num_inputs()
        out_specs = (P(), specs, P()) + (P(),) * (self.has_aux + self.model.has_state)
        return jax.shard_map(
            self.per_device(phase),
            mesh=self.mesh,
            in_specs=(P(), specs, *model_specs, P(self._axes)),
            out_specs=out_specs,
        )

    def _build(self, phase):
        specs = self._state_specs.specs
        replicated = NamedSharding(self.mesh, P())
        in_shardings = (
            replicated,
            self._shardings(specs),
            *[replicated] * self.model.num_inputs(),
            NamedSharding(self.mesh, P(self._axes)),
        )
        outputs = 1 + self.has_aux + self.model.has_state
        return jax.jit(
            self.sharded(None, phase),
            in_shardings=in_shardings,
            out_shardings=(replicated, self._shardings(specs), *[replicated] * outputs),
            # The model state too: the step returns its new value in a buffer of its own.
            donate_argnums=(0, 1, *[2] * self.model.has_state) if self._donate else (),
        )

    def _inputs(self, state, batch):
        self._state_specs(state.opt_state)
        batch = global_batch(batch, self.mesh, self._axes)
        return (state.params, state.opt_state, *self.model.inputs(state), batch)

    def _outputs(self, state, out):
        metrics = {"loss": out[2]}
        if self.has_aux:
            metrics["aux"] = out[3]
        extra = self.model.carried(state, out[-1] if self.model.has_state else None)
        return TrainState(count(int(state.step) + 1), out[0], out[1], extra), metrics


def data_parallel_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation | Mapping[str, optax.GradientTransformation],
    mesh: Mesh,
    *,
    has_aux: bool = False,
    donate: bool = True,
    node_axis: str = "node",
    local_axis: str = "local",
    phase_of: Callable[[int], str] | None = None,
    flatten: bool = False,
    model_state: Any = None,
    rng_seed: int | None = None,
    state_sync: StateSync = "mean",
) -> DataParallelStep:
    """Builds a data-parallel train step over a ("node", "local") mesh.

    Parameters and optimizer state are replicated (error-feedback residuals are each
    device's own); the batch is split over both mesh axes along its leading dimension. Each
    device differentiates ``loss_fn`` on its own slice and hands the per-device gradient to
    ``optimizer``, whose first transformation must average it (``bytegrad()``,
    ``gradient_allreduce()``, or ``qadam()``). The parameters are marked as varying per
    device before differentiation: otherwise ``jax.grad`` of a replicated parameter inside
    ``shard_map`` returns it already summed, through a hidden float32 all-reduce that would
    make compression pointless.

    The step is one ``jax.jit`` with in and out shardings, donating the state's buffers;
    ``init`` places the state where the step expects it.

    A model with state that is not trained (BatchNorm's statistics) or that draws random
    numbers (dropout) opts in by keyword (docs/strategy.md, "Model state and randomness"):
    with ``model_state=`` the loss function is called ``loss_fn(params, batch,
    model_state=...)`` and returns ``(loss, new_model_state)``; with ``rng_seed=`` it also
    gets ``key=``, a key of its own per device and per step.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``),
        computed on one device's slice of the batch; with ``model_state``/``rng_seed``,
        ``loss_fn(params, batch, model_state=..., key=...) -> (loss, new_model_state)``.
      optimizer: an optax transformation that synchronizes the gradient first; or one per
        phase, ``{name: transformation}`` with the same state structure, with ``phase_of``
        (``qadam(phase=...)``'s two phases, for instance).
      mesh: from ``make_mesh``.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``; float aux leaves are averaged.
      donate: donate the params and optimizer-state buffers to the step: pass it the state
        it returned, not one it already consumed (or False to keep the inputs).
      node_axis: the mesh axis between nodes.
      local_axis: the mesh axis within a node.
      phase_of: with one optimizer per phase, ``phase_of(steps_taken) -> name``: which one
        a step runs, decided on the host (each phase is its own compiled program).
      flatten: keep the params, gradient and optimizer state as one float32 vector (Bagua's
        fused optimizer); the loss function still gets the pytree.
      model_state: the model's state that is not trained, to start from (a pytree of
        numeric arrays: batch statistics, counters); carried in ``state.model_state``,
        replicated. None (default): the loss function takes none.
      rng_seed: seeds ``state.rng``; the loss function then gets ``key=``, which differs
        per device and per step (``step_key``) and replays after a restart. None: no key.
      state_sync: how the devices' new model states become one after each step:
        ``"mean"`` averages the float leaves over the mesh, as cross-replica BatchNorm does
        (integer leaves come from device 0); ``"first"`` takes every leaf from device 0, as
        DDP's ``broadcast_buffers``. One all-reduce of the state's bytes either way.

    Returns:
      A ``TrainStep``: ``state = step.init(params)``, ``state, metrics = step(state,
      batch)`` with ``metrics["loss"]`` the mean over all devices, ``step.params(state)``.
      ``step.sharded(opt_state)`` is the same step un-jitted, for a ``jax.jit`` of your own.

    Raises:
      ValueError: for axis names the mesh lacks, several optimizers without ``phase_of``, a
        bad ``model_state``, ``rng_seed`` or ``state_sync``; at ``init``, for a parameter
        that is not floating point; when stepping, for a state another step made, a batch
        whose leading dimension does not split over the devices, a state a donating step
        already consumed, or an optimizer that leaves the updates different on different
        devices.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> tx = optax.chain(jax_bytegrad.bytegrad(), optax.sgd(0.1))
      >>> step = jax_bytegrad.data_parallel_step(lambda w, b: jnp.mean((b * w) ** 2), tx, mesh)
      >>> state = step.init(jnp.ones(4))
      >>> state, metrics = step(state, jnp.ones((8, 4)))
      >>> float(metrics["loss"]), int(state.step)
      (1.0, 1)

    References:
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    where = "data_parallel_step"
    if isinstance(optimizer, optax.GradientTransformation):
        if phase_of is not None:
            raise ValueError(f"{where}: phase_of needs one optimizer per phase, {{name: tx}}")
        optimizers, phase_of = {"step": optimizer}, lambda _: "step"
    else:
        optimizers = dict(optimizer)
        bad = [k for k, v in optimizers.items() if not isinstance(v, optax.GradientTransformation)]
        if not optimizers or bad or phase_of is None:
            raise ValueError(
                f"{where}: optimizer must be an optax.GradientTransformation, or a non-empty "
                "{phase name: transformation} mapping with phase_of=...; got "
                f"{type(optimizer).__name__}"
            )
    return DataParallelStep(
        loss_fn,
        optimizers,
        phase_of,
        mesh,
        has_aux=has_aux,
        donate=donate,
        axes=(node_axis, local_axis),
        flatten=flatten,
        model=ModelState.of(model_state, rng_seed, state_sync, where),
    )
