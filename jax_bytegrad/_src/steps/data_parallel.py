"""A data-parallel train step around any optax optimizer over a ("node", "local") mesh.

Follows Bagua's data-parallel model (Gan et al., "Bagua: Scaling up Distributed Learning with
System Relaxations", VLDB 2022): parameters and optimizer state are replicated, each device
computes the gradient of its slice of the batch, and the optimizer's first transformation
(``bytegrad``, ``gradient_allreduce``, ``qadam``) averages what must be averaged.

With ``shard=`` the state is split within each node (``shards.py``; ZeRO within the node, as
HSDP): per device, inside ``jax.shard_map``,

    shard="optimizer": params whole, optimizer state in blocks
        grads = grad of the loss at the whole params (each device its own batch slice)
        update = optimizer(grads, state blocks): the sync reduce-scatters each bucket within
            the node, in rows of this device's blocks, then crosses between nodes
        params = all_gather within the node of (block + update)
    shard="params": params in blocks too
        the loss gathers each block within the node where it runs; jax.grad of a gather is
        the reduce-scatter, so the gradient arrives as this device's block of the node sum
        update = optimizer(node sums, state blocks): the sync only crosses between nodes
        params = block + update

Leaves that the node's devices cannot split stay whole (summed within the node by a psum with
"params"). The optimizer's sync (``bytegrad``, ``gradient_allreduce``, ``qadam``) is told all
this by the extra argument ``sharded`` (``shards.Sharded``): its rows have the sizes, wires
and residuals of the replicated step's shards.
"""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.extend
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks, shards
from jax_bytegrad._src.collective_ops import make_varying
from jax_bytegrad._src.sharding import replicate, state_specs
from jax_bytegrad._src.shards import Shard, Sharded
from jax_bytegrad._src.steps.base import (
    Program,
    TrainState,
    TrainStep,
    count,
    global_batch,
    host_copy,
)
from jax_bytegrad._src.steps.model_state import ModelState, StateSync

# With shard="params" on GPUs: the largest combined reduce-scatter within the node. Measured on
# deviceless 2 x 8 H100s (an MLP of 8 2048 x 2048 layers): 30 MiB (XLA's default) starts no
# byte between nodes before the last gemm, 16 MiB none, 4 MiB half of them.
RS_COMBINE_BYTES = 4 * 2**20


def _spec_axes(spec) -> set[str]:
    """The mesh axes a ``PartitionSpec`` splits over."""
    names = set()
    for entry in spec:
        names.update(entry if isinstance(entry, tuple) else () if entry is None else (entry,))
    return names


def _unsynced(updates, update_specs, opt_state, specs, axes) -> list[str]:
    """Paths of updates, or state, that differ between devices where they should not: a leaf
    may vary over the axes its spec splits it over, and no other."""
    leaves = jax.tree.leaves_with_path((updates, opt_state))
    if update_specs is None:  # replicated: no update may vary
        update_specs = jax.tree.map(lambda _: P(), updates)
    allowed = [_spec_axes(spec) for spec in jax.tree.leaves((update_specs, specs))]
    return [
        jax.tree_util.keystr(path)
        for (path, leaf), ok in zip(leaves, allowed, strict=True)
        if (checks.varying_axes(leaf) & set(axes)) - ok
    ]


def _traced(fn, *args):
    """``fn(*args)``, traced once: its jaxpr, and its result computed from that jaxpr."""
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    out = jax.extend.core.jaxpr_as_fun(closed)(*jax.tree.leaves(args))
    return closed, jax.tree.unflatten(jax.tree.structure(shape), out)


def traced_gradient(grad_fn, params, *args):
    """``grad_fn(params, *args)`` (whose result ends with the gradient), traced once, and the
    params' leaf indices in the order its backward pass produces their gradients (ties: last
    leaf first), read from that trace.

    The sync of each bucket of the gradient runs in this order (``buckets.ready_order``), so
    that the first bucket to cross between nodes is the first one complete.
    """
    closed, out = _traced(grad_fn, params, *args)
    produced = {}
    for index, equation in enumerate(closed.jaxpr.eqns):
        for var in equation.outvars:
            produced[id(var)] = index
    leaves = len(jax.tree.leaves(params))
    ranks = [produced.get(id(var), -1) for var in closed.jaxpr.outvars[-leaves:]]
    order = tuple(sorted(range(leaves), key=lambda i: (ranks[i], -i)))
    return out, order


class DataParallelStep(TrainStep):
    """The ``TrainStep`` of ``data_parallel_step``: one program per optimizer phase."""

    def __init__(self, algorithm, loss_fn, optimizers, phase_of, mesh, *, has_aux, donate,
                 axes, flatten, model=None, shard: Shard | None = None):  # fmt: skip
        super().__init__(
            algorithm, mesh, loss_fn, axes=axes, has_aux=has_aux, flatten=flatten,
            donate=donate, model=model,
        )  # fmt: skip
        self._optimizers = dict(optimizers)
        self._phase_of = phase_of
        self.phases = tuple(self._optimizers)
        self.shard = shard
        self._local = int(mesh.shape[axes[1]])
        # The specs of the params and of the optimizer state, from the first state seen.
        self._specs = None

    def _phase(self, steps_taken: int) -> tuple[str, Any]:
        name = self._phase_of(steps_taken)
        if name not in self._optimizers:
            raise ValueError(
                f"{self.algorithm}: phase_of({steps_taken}) gave {name!r}, which is not one of "
                f"the optimizers' phases {self.phases}"
            )
        return name, name

    # Where the state lives. ---------------------------------------------------------------

    def _init_fn(self):
        return next(iter(self._optimizers.values())).init

    def _expected_opt_state(self, params):
        return jax.eval_shape(self._init_fn(), params)

    def _param_specs(self, params):
        if self.shard != "params":
            return jax.tree.map(lambda _: P(), params)
        return shards.leaf_specs(params, self._axes[1], self._local)

    def _state_specs(self, opt_state, params):
        if self.shard is None:
            return state_specs(opt_state, node_axis=self._axes[0], local_axis=self._axes[1])
        return shards.state_specs(opt_state, params, axes=self._axes, local=self._local)

    def _learn_specs(self, params, opt_state) -> tuple:
        """The specs of ``(params, opt_state)``, kept from the first state this step sees: a
        step's state keeps its layout from step to step."""
        if self._specs is None:
            self._specs = (self._param_specs(params), self._state_specs(opt_state, params))
            local = self._local if self.shard else 1
            self._dims = shards.split_dims(params, local)
            # What each device's update is: its blocks of the split leaves.
            self._update_specs = shards.leaf_specs(params, self._axes[1], local)
        return self._specs

    def _shardings(self, specs):
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs)

    def _init_program(self, params):
        """The optimizer's init, jitted to place its state where it lives."""
        init = self._init_fn()
        param_specs, specs = self._learn_specs(params, jax.eval_shape(init, params))
        return jax.jit(
            init, in_shardings=(self._shardings(param_specs),), out_shardings=self._shardings(specs)
        )

    def _init(self, params) -> TrainState:
        params = host_copy(params)
        if self.shard == "params":
            params = jax.tree.map(
                lambda x, s: jax.make_array_from_callback(x.shape, s, lambda i, x=x: x[i]),
                params,
                self._shardings(self._param_specs(params)),
            )
        else:
            params = replicate(params, self.mesh)
        return TrainState(count(0), params, self._init_program(params)(params), {})

    def _state_shapes(self, params) -> TrainState:
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            params,
            self._shardings(self._param_specs(params)),
        )
        return TrainState(count(0), params, self._init_program(params).eval_shape(params), {})

    # The program. -------------------------------------------------------------------------

    def _loss(self):
        """The loss of the params as the step holds them: with ``shard="params"``, each block
        is gathered within the node where the loss uses it."""
        if self.shard != "params":
            return self.loss_fn
        dims, axis, loss_fn = self._dims, self._axes[1], self.loss_fn

        def loss(blocks, batch, **kwargs):
            leaves, treedef = jax.tree.flatten(blocks)
            whole = [
                shards.gather_block(x, d, axis, invariant=False)
                for x, d in zip(leaves, dims, strict=True)
            ]
            return loss_fn(jax.tree.unflatten(treedef, whole), batch, **kwargs)

        return loss

    def _handed(self, grads, params):
        """With ``shard=``: what the optimizer gets (``shards.Sharded``), and this device's
        blocks of the params. ``"optimizer"``: each device's gradient, which the sync sums
        within the node bucket by bucket. ``"params"``: the node's sums (jax.grad of the
        in-loss gather summed the split leaves; a psum sums the whole ones)."""
        axis, dims = self._axes[1], self._dims
        if self.shard == "optimizer":
            leaves, treedef = jax.tree.flatten(params)
            own = [shards.own_block(x, d, axis) for x, d in zip(leaves, dims, strict=True)]
            return grads, jax.tree.unflatten(treedef, own)
        leaves, treedef = jax.tree.flatten(grads)
        sums = [
            x if d is not None else shards.node_sum(x, None, axis)
            for x, d in zip(leaves, dims, strict=True)
        ]
        return jax.tree.unflatten(treedef, sums), params

    def per_device(self, phase: str | None = None) -> Callable:
        """The un-jitted, un-mapped step of one device, for a ``shard_map`` of your own:
        ``(params, opt_state, batch) -> (params, opt_state, loss[, aux])``.

        ``loss`` (and ``aux``) are means over every device. ``phase`` picks the optimizer of
        a step with several; None for the only one. A step built with ``model_state=``
        or ``rng_seed=`` takes ``(params, opt_state, *model_inputs, batch)``, the model
        inputs being ``state.model_state``, then ``state.rng`` and the step count as uint32,
        and returns the synced model state last. With ``shard=``, ``init`` or
        ``state_shapes`` must have been called first (they fix the layout).
        """
        optimizer = optax.with_extra_args_support(
            self._optimizers[phase if phase is not None else self.phases[0]]
        )
        axes, has_aux, model, shard = self._axes, self.has_aux, self.model, self.shard
        grad_fn = model.value_and_grad(self._loss(), has_aux, axes)
        _, specs = self._specs
        update_specs, dims = self._update_specs, self._dims

        def step(params, opt_state, *rest):
            *model_inputs, batch = rest
            # Varying params: jax.grad of a replicated value would come back already summed
            # over the devices, through a hidden float32 all-reduce.
            varying = make_varying(params, axes)
            traced, order = traced_gradient(grad_fn, varying, batch, *model_inputs)
            (loss, aux, model_state), grads = traced
            extra = {"gradient_order": order}
            own = params
            if shard is None:
                updates, opt_state = optimizer.update(grads, opt_state, own, **extra)
            else:
                grads, own = self._handed(grads, params)
                extra["sharded"] = Sharded(axes[1], dims, summed=shard == "params")
                update = functools.partial(optimizer.update, **extra)
                closed, (updates, opt_state) = _traced(update, grads, opt_state, own)
                shards.check_elementwise(closed.jaxpr, self.algorithm)
            unsynced = _unsynced(updates, update_specs, opt_state, specs, axes)
            if unsynced:
                raise ValueError(
                    f"{self.algorithm}: the optimizer leaves updates or state that differ "
                    f"between devices ({', '.join(unsynced[:3])}); put jax_bytegrad.bytegrad() "
                    "or gradient_allreduce() first in the optax chain, or use "
                    "jax_bytegrad.qadam()"
                )
            params = optax.apply_updates(own, updates)
            if shard == "optimizer":
                params = jax.tree.map(
                    lambda x, d: shards.gather_block(x, d, axes[1], invariant=True),
                    params,
                    jax.tree.unflatten(jax.tree.structure(params), dims),
                )
            out = (params, opt_state, jax.lax.pmean(loss, axes))
            out += (jax.lax.pmean(aux, axes),) if has_aux else ()
            return out + ((model_state,) if model.has_state else ())

        return step

    def sharded(self, opt_state, phase: str | None = None) -> Callable:
        """The step as one ``jax.shard_map`` over the mesh, not jitted: call it inside a
        ``jax.jit`` of your own. ``opt_state`` (or its ``jax.eval_shape``) gives the specs
        (with ``shard=``, call ``init`` or ``state_shapes`` first)."""
        if self._specs is None:
            if self.shard is not None:
                raise ValueError(
                    f"{self.algorithm}: with shard={self.shard!r}, call step.init(params) or "
                    "step.state_shapes(params) before sharded(...): they fix the layout"
                )
            self._specs = ((), self._state_specs(opt_state, None))
            self._dims = self._update_specs = None
        param_specs, specs = self._specs
        params_spec = param_specs if self.shard == "params" else P()
        model_specs = (P(),) * self.model.num_inputs()
        out_specs = (params_spec, specs, P()) + (P(),) * (self.has_aux + self.model.has_state)
        return jax.shard_map(
            self.per_device(phase),
            mesh=self.mesh,
            in_specs=(params_spec, specs, *model_specs, P(self._axes)),
            out_specs=out_specs,
        )

    def program(self, state: TrainState) -> Program:
        self._learn_specs(state.params, state.opt_state)
        return super().program(state)

    def _build(self, phase) -> Program:
        param_specs, specs = self._specs
        replicated = NamedSharding(self.mesh, P())
        params = self._shardings(param_specs) if self.shard == "params" else replicated
        in_shardings = (
            params,
            self._shardings(specs),
            *[replicated] * self.model.num_inputs(),
            NamedSharding(self.mesh, P(self._axes)),
        )
        outputs = 1 + self.has_aux + self.model.has_state
        options = None
        if self.shard == "params" and self.mesh.devices.flat[0].platform == "gpu":
            # jax.grad of the in-loss gathers reduce-scatters each leaf within the node, and
            # XLA:GPU's combiner (30 MiB) would merge them all after the last gradient,
            # holding every exchange between nodes back (benchmarks/RESULTS.md, "Sharded
            # state on GPU").
            options = {"xla_gpu_reduce_scatter_combine_threshold_bytes": RS_COMBINE_BYTES}
        fn = jax.jit(
            self.sharded(None, phase),
            compiler_options=options,
            in_shardings=in_shardings,
            out_shardings=(params, self._shardings(specs), *[replicated] * outputs),
            # The model state too: the step returns its new value in a buffer of its own.
            donate_argnums=(0, 1, *[2] * self.model.has_state) if self._donate else (),
        )
        return Program(fn, self._inputs, self._outputs)

    def _inputs(self, state, batch):
        self._learn_specs(state.params, state.opt_state)
        batch = global_batch(batch, self.mesh, self._axes)
        return (state.params, state.opt_state, *self.model.inputs(state), batch)

    def _outputs(self, state, out):
        metrics = {"loss": out[2]}
        if self.has_aux:
            metrics["aux"] = out[3]
        extra = self.model.carried(state, out[-1] if self.model.has_state else None)
        return TrainState(state.step, out[0], out[1], extra), metrics


def optimizers_of(optimizer, phase_of, where: str) -> tuple[dict, Callable[[int], str]]:
    """``{phase: transformation}`` and ``phase_of`` from ``data_parallel_step``'s
    ``optimizer`` and ``phase_of``; raises a ``ValueError`` for anything else."""
    if isinstance(optimizer, optax.GradientTransformation):
        if phase_of is not None:
            raise ValueError(f"{where}: phase_of needs one optimizer per phase, {{name: tx}}")
        return {"step": optimizer}, lambda _: "step"
    optimizers = dict(optimizer) if isinstance(optimizer, Mapping) else {}
    bad = [k for k, v in optimizers.items() if not isinstance(v, optax.GradientTransformation)]
    if not optimizers or bad or phase_of is None:
        raise ValueError(
            f"{where}: optimizer must be an optax.GradientTransformation, or a non-empty "
            "{phase name: transformation} mapping with phase_of=...; got "
            f"{type(optimizer).__name__}"
        )
    return optimizers, phase_of


def check_shard(shard, flatten: bool, where: str) -> None:
    """Validates ``shard=``."""
    if shard is not None:
        checks.one_of(shard, shards.SHARDS, "shard", where)
        if flatten:
            raise ValueError(
                f"{where}: shard={shard!r} splits each parameter within the node and "
                "flatten=True makes them one vector; use one of them"
            )


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
    shard: Shard | None = None,
) -> DataParallelStep:
    """Builds a data-parallel train step over a ("node", "local") mesh.

    Parameters and optimizer state are replicated (error-feedback residuals are each
    device's own), or split within each node with ``shard=``; the batch is split over both
    mesh axes along its leading dimension. Each
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
      shard: None (default): every device holds the whole state. ``"optimizer"``: each of a
        node's L devices keeps and updates 1/L of the optimizer state and of the params, and
        the updated params are gathered within the node (ZeRO-1/2 within the node).
        ``"params"``: the params rest split too, and are gathered within the node where the
        loss uses them (ZeRO-3 within the node, HSDP). Each leaf is split along its first
        dimension that L divides; others stay whole. Between nodes nothing changes: the
        optimizer's sync sends each device's share of its node's sum, as with
        ``hierarchical=True``. The optimizer after the sync must be elementwise (Adam, SGD,
        AdamW, Lion...), as it runs on blocks; docs/sharding.md.

    Returns:
      A ``TrainStep``: ``state = step.init(params)``, ``state, metrics = step(state,
      batch)`` with ``metrics["loss"]`` the mean over all devices, ``step.params(state)``.
      ``step.sharded(opt_state)`` is the same step un-jitted, for a ``jax.jit`` of your own.

    Raises:
      ValueError: for axis names the mesh lacks, several optimizers without ``phase_of``, a
        bad ``model_state``, ``rng_seed``, ``state_sync`` or ``shard`` (or ``shard`` with
        ``flatten``); at ``init``, for a parameter
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
    optimizers, phase_of = optimizers_of(optimizer, phase_of, where)
    check_shard(shard, flatten, where)
    return DataParallelStep(
        where,
        loss_fn,
        optimizers,
        phase_of,
        mesh,
        has_aux=has_aux,
        donate=donate,
        axes=(node_axis, local_axis),
        flatten=flatten,
        model=ModelState.of(model_state, rng_seed, state_sync, where),
        shard=shard,
    )
