"""A data-parallel train step around any optax optimizer over a ("node", "local") mesh.

Follows Bagua's data-parallel model (Gan et al., "Bagua: Scaling up Distributed Learning with
System Relaxations", VLDB 2022): parameters and optimizer state are replicated, each device
computes the gradient of its slice of the batch, and the optimizer's first transformation
(``bytegrad``, ``gradient_allreduce``, ``qadam``) averages what must be averaged.
"""

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks
from jax_bytegrad._src.sharding import StateSpecs, replicate
from jax_bytegrad._src.steps.base import (
    TrainState,
    TrainStep,
    count,
    global_batch,
    host_copy,
)


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


class DataParallelStep(TrainStep):
    """The ``TrainStep`` of ``data_parallel_step``: one program per optimizer phase."""

    def __init__(self, loss_fn, optimizers, phase_of, mesh, *, has_aux, donate, axes, flatten):
        super().__init__(
            "data_parallel_step", mesh, loss_fn, axes=axes, has_aux=has_aux, flatten=flatten,
            donate=donate,
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

    def _init(self, params) -> TrainState:
        params = replicate(host_copy(params), self.mesh)
        init = next(iter(self._optimizers.values())).init
        specs = self._state_specs(jax.eval_shape(init, params))
        # Born where they live: replicated state on every device, residuals per device.
        opt_state = jax.jit(init, out_shardings=self._shardings(specs))(params)
        return TrainState(count(0), params, opt_state, {})

    def per_device(self, phase: str | None = None) -> Callable:
        """The un-jitted, un-mapped step of one device, for a ``shard_map`` of your own:
        ``(params, opt_state, batch) -> (params, opt_state, loss[, aux])``.

        ``loss`` (and ``aux``) are means over every device. ``phase`` picks the optimizer of
        a step with several; None for the only one.
        """
        optimizer = self._optimizers[phase if phase is not None else self.phases[0]]
        grad_fn = jax.value_and_grad(self.loss_fn, has_aux=self.has_aux)
        axes, has_aux = self._axes, self.has_aux

        def step(params, opt_state, batch):
            # Varying params: jax.grad of a replicated value would come back already summed
            # over the devices, through a hidden float32 all-reduce.
            out, grads = grad_fn(jax.lax.pcast(params, axes, to="varying"), batch)
            loss, aux = out if has_aux else (out, None)
            updates, opt_state = optimizer.update(grads, opt_state, params)
            unsynced = _unsynced(updates, opt_state, self._state_specs(opt_state), axes)
            if unsynced:
                raise ValueError(
                    "data_parallel_step: the optimizer leaves updates or state that differ "
                    f"between devices ({', '.join(unsynced[:3])}); put jax_bytegrad.bytegrad() "
                    "or gradient_allreduce() first in the optax chain, or use "
                    "jax_bytegrad.qadam()"
                )
            params = optax.apply_updates(params, updates)
            loss = jax.lax.pmean(loss, axes)
            if has_aux:
                return params, opt_state, loss, jax.lax.pmean(aux, axes)
            return params, opt_state, loss

        return step

    def sharded(self, opt_state, phase: str | None = None) -> Callable:
        """The step as one ``jax.shard_map`` over the mesh, not jitted: call it inside a
        ``jax.jit`` of your own. ``opt_state`` (or its ``jax.eval_shape``) gives the specs."""
        specs = self._state_specs(opt_state)
        out_specs = (P(), specs, P(), P()) if self.has_aux else (P(), specs, P())
        return jax.shard_map(
            self.per_device(phase),
            mesh=self.mesh,
            in_specs=(P(), specs, P(self._axes)),
            out_specs=out_specs,
        )

    def _build(self, phase):
        specs = self._state_specs.specs
        in_shardings = (
            NamedSharding(self.mesh, P()),
            self._shardings(specs),
            NamedSharding(self.mesh, P(self._axes)),
        )
        out_shardings = (*in_shardings[:2], *[NamedSharding(self.mesh, P())] * (2 + self.has_aux))
        return jax.jit(
            self.sharded(None, phase),
            in_shardings=in_shardings,
            out_shardings=out_shardings[: 3 + self.has_aux],
            donate_argnums=(0, 1) if self._donate else (),
        )

    def _inputs(self, state, batch):
        self._state_specs(state.opt_state)
        return state.params, state.opt_state, global_batch(batch, self.mesh, self._axes)

    def _outputs(self, state, out):
        metrics = {"loss": out[2]}
        if self.has_aux:
            metrics["aux"] = out[3]
        return TrainState(count(int(state.step) + 1), out[0], out[1], {}), metrics


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

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``),
        computed on one device's slice of the batch.
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

    Returns:
      A ``TrainStep``: ``state = step.init(params)``, ``state, metrics = step(state,
      batch)`` with ``metrics["loss"]`` the mean over all devices, ``step.params(state)``.
      ``step.sharded(opt_state)`` is the same step un-jitted, for a ``jax.jit`` of your own.

    Raises:
      ValueError: for axis names the mesh lacks, several optimizers without ``phase_of``;
        when stepping, for a batch whose leading dimension does not split over the devices,
        a state a donating step already consumed, or an optimizer that leaves the updates
        different on different devices.

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
    )
