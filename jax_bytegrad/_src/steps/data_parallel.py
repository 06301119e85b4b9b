"""A data-parallel train step around any optax optimizer over a ("node", "local") mesh.

Follows Bagua's data-parallel model (Gan et al., "Bagua: Scaling up Distributed Learning with
System Relaxations", VLDB 2022): parameters and optimizer state are replicated, each device
computes the gradient of its slice of the batch, and the optimizer's first transformation
(``bytegrad``, ``gradient_allreduce``, ``qadam``) averages what must be averaged.

With ``shard=`` the state is split (within each node, or over every device with ``"full"``),
and where it lives is one placement object (``sharding/placement.py``) that gives the step its
specs, its gradient, the frame of its update and its compiler options; the step never
branches on the setting. The optimizer's sync (``bytegrad``, ``gradient_allreduce``,
``qadam``) is told the layout by the extra argument ``sharded`` (``shards.Sharded``). Which
program a step runs, its phase, is ``phases.py``'s.
"""

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks
from jax_bytegrad._src.axes import LOCAL_AXIS, NODE_AXIS
from jax_bytegrad._src.sharding import rule
from jax_bytegrad._src.sharding.placement import StateLayout, check_shard, placement_of, shapes_key
from jax_bytegrad._src.sharding.rule import Shard
from jax_bytegrad._src.steps import accumulation as accumulation_lib
from jax_bytegrad._src.steps import loop_exchange, loop_gather, loop_marks
from jax_bytegrad._src.steps.accumulation import Accumulation
from jax_bytegrad._src.steps.base import (
    Program,
    StepState,
    TrainStep,
    abstract,
    count,
    global_batch,
    host_copy,
)
from jax_bytegrad._src.steps.model_state import ModelState, StateSync
from jax_bytegrad._src.steps.phases import Phases, accumulates, gradient_phase, optimizers_of
from jax_bytegrad._src.steps.tracing import traced, traced_gradient
from jax_bytegrad._src.sync.patterns import make_varying


class DataParallelStep(TrainStep):
    """``data_parallel_step``'s ``TrainStep``: a program per optimizer phase (and one for the
    micro-steps that accumulate), for each layout of params it is given."""

    def __init__(self, algorithm, loss_fn, optimizers, phase_of, mesh, *, has_aux, donate,
                 axes, flatten, model=None, shard: Shard | None = None,
                 accumulation: Accumulation | None = None,
                 loop_syncs: Mapping[str, Any] | None = None):  # fmt: skip
        super().__init__(
            algorithm, mesh, loss_fn, axes=axes, has_aux=has_aux, flatten=flatten,
            donate=donate, model=model,
        )  # fmt: skip
        self._optimizers = dict(optimizers)
        self.shard = shard
        self.placement = placement_of(shard, mesh, axes)
        self.accumulation = accumulation
        if accumulation is not None:
            self._extra_keys = (accumulation_lib.ACCUMULATED,)
        self._layouts: dict[Any, StateLayout] = {}
        # Per phase, what the sync does to a layer marked ``exchange_in_loop`` inside the
        # backward loop (``loop_exchange.LoopSync``); a phase without one, and any phase of a
        # placement that cannot exchange in the loop, leaves marks as identities. A step that
        # accumulates exchanges once per k micro-steps, after the loop; but where the state is
        # split across nodes, only the loop can: each micro-step's gradient crosses there,
        # and the accumulator holds this device's blocks of the mean (``_micro_exchange``).
        gathers = self.placement.gathers_across_nodes
        self._micro_exchange = gathers and accumulation is not None
        self._phases = Phases(
            self._optimizers, phase_of, accumulation, self._micro_exchange, algorithm
        )
        self.phases = self._phases.names
        in_loop = self.placement.exchanges_in_loop and (accumulation is None or gathers)
        self._loop_syncs = {
            k: s for k, s in (loop_syncs or {}).items() if s is not None and in_loop
        }
        # The loop's sync that keeps error feedback (``LoopSync.feeds_back``), if any; and per
        # params' shapes, the loss's marks the state's residuals are laid out for
        # (``init(params, batch)``).
        syncs = self._loop_syncs.values()
        self._feeding = next((s for s in syncs if s.feeds_back), None)
        self._fed: dict[Any, tuple] = {}
        self.placement.check_step(algorithm, self._optimizers, self._loop_syncs)

    def _phase(self, steps_taken: int) -> tuple[str, Any]:
        return self._phases.of(steps_taken)

    # Where the state lives. ---------------------------------------------------------------

    def _init_fn(self):
        init = next(iter(self._optimizers.values())).init

        def init_fn(params):
            state = init(params)
            if self._feeding is None:
                return state
            config = self._feeding.config
            if self.placement.gathers_across_nodes:
                # Each split leaf's gradient crosses in the backward pass, marked or not: its
                # residual is laid out from the params' shapes alone, after the sync's own.
                dims = self.placement.dims(params)
                residuals = loop_marks.gathered_residuals(params, dims, config, self.mesh)
                return optax.tree.set(state, residuals=residuals)
            calls = self._fed.get(shapes_key(params))
            if calls is None:
                return state
            # The sync after the backward pass keeps the unmarked leaves' residuals, the loop
            # each marked layer's (``loop_marks.fed_residuals``).
            residuals = loop_marks.initial_residuals(params, calls, config, self.mesh)
            return optax.tree.set(state, residuals=residuals)

        return init_fn

    def _fit_state(self, state: StepState, batch, shapes: bool) -> StepState:
        """``state`` (of ``shapes`` only, or arrays) with its residuals laid out for the
        loss's marks on ``batch``, where the loop's exchange keeps error feedback
        (``loop_marks.fed_residuals``)."""
        if self._feeding is None or self.placement.gathers_across_nodes:
            return state  # (``shard="full"``: laid out by ``init`` alone)
        if not all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(batch)):
            batch = global_batch(batch, self.mesh, self._axes)
        calls = self._mark_calls(
            self._layout(state.params),
            abstract(state.params), abstract(batch), self.model.inputs(state),
        )  # fmt: skip
        key = shapes_key(state.params)
        if not calls or self._fed.get(key) == calls:
            return state
        self._fed[key] = calls  # a new layout, with programs of its own
        init = self._init_program(self._layout(state.params))
        return state._replace(opt_state=(init.eval_shape if shapes else init)(state.params))

    def _mark_calls(self, layout: StateLayout, params, batch, model_inputs):
        """The loss's ``exchange_in_loop`` calls (``loop_marks.mark_calls``), from one trace
        of the step's gradient on ``params`` and the global ``batch`` (shapes), laid out as
        ``layout`` says, with ``model_inputs`` (``ModelState.inputs``)."""
        placement, found = self.placement, []

        def probe(fn, args):
            found.append(loop_marks.mark_calls(fn, len(layout.dims), *args))
            return fn, (), None

        grad_fn = placement.value_and_grad(self.model, self.loss_fn, self.has_aux, probe)

        def loss(params, batch, *model_inputs):
            outputs = grad_fn(params, batch, *model_inputs)[0]
            return jax.lax.pmean(outputs[0], placement.manual_axes)

        in_specs = (layout.params, P(self._axes), *(P(),) * len(model_inputs))
        jax.eval_shape(placement.shard_map(loss, in_specs, P()), params, batch, *model_inputs)
        return found[0]

    def _accumulated(self, params) -> dict:
        """``extra``'s accumulator as placed ``ShapeDtypeStruct``s; empty without one."""
        if self.accumulation is None:
            return {}
        specs = self.placement.accumulator_specs(params)
        acc = accumulation_lib.shapes(params, self.mesh, self.accumulation, specs)
        return {accumulation_lib.ACCUMULATED: acc}

    def _expected_opt_state(self, params):
        return jax.eval_shape(self._init_fn(), params)

    def _layout(self, params) -> StateLayout:
        """The specs of a state whose params are ``params`` (arrays or shapes), as the
        placement gives them for their shapes (and the marks the state was fitted to,
        ``_fit_state``)."""
        given = shapes_key(params)
        key = (given, self._fed.get(given))
        if key not in self._layouts:
            placement = self.placement
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
            acc = self._accumulated(shapes)
            self._layouts[key] = StateLayout(
                key,
                placement.dims(shapes),
                placement.param_specs(shapes),
                placement.state_specs(jax.eval_shape(self._init_fn(), shapes), shapes),
                placement.update_specs(shapes),
                accumulation_lib.specs(acc[accumulation_lib.ACCUMULATED]) if acc else None,
            )
        return self._layouts[key]

    def _shardings(self, specs):
        return jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs)

    def _init_program(self, layout: StateLayout):
        """The optimizer's init, jitted to place its state where it lives."""
        return jax.jit(
            self._init_fn(),
            in_shardings=(self._shardings(layout.params),),
            out_shardings=self._shardings(layout.opt_state),
        )

    def _init(self, params) -> StepState:
        params = self.placement.place(host_copy(params))
        layout = self._layout(params)
        extra = jax.tree.map(accumulation_lib.zeros, self._accumulated(params))
        return StepState(count(0), params, self._init_program(layout)(params), extra)

    def _state_shapes(self, params) -> StepState:
        layout = self._layout(params)
        params = jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            params,
            self._shardings(layout.params),
        )
        opt_state = self._init_program(layout).eval_shape(params)
        accumulated = self._accumulated(params)
        return StepState(count(0), params, opt_state, accumulated)

    # The program. -------------------------------------------------------------------------

    def _gradient(self, layout: StateLayout, phase: str | None = None):
        """``(params, batch, *model_inputs) -> ((loss, aux, model_state), grads, order,
        exchanged, residuals)``: what the placement hands the optimizer: each device's
        gradient, or its node's sums in blocks; ``exchanged`` says, per leaf, which the
        backward pass averaged between nodes already (``exchange_in_loop``; empty: none), and
        ``residuals`` are those layers' new error-feedback residuals (None without)."""
        placement = self.placement
        loop = self._loop_syncs.get(phase)
        grad_fn = placement.value_and_grad(self.model, self.loss_fn, self.has_aux)

        def gradient(params, batch, *model_inputs, opt_state=None, micro=None):
            """``opt_state``: the optimizer's state, from which an exchange in the loop takes
            what it needs (``LoopSync.from_state``); ``micro``: the micro-step's index, that
            each micro-step's exchange rounds on keys of its own."""
            exchange, marked = grad_fn, []
            if loop is not None:
                if placement.gathers_across_nodes:
                    rewrite = loop_gather.gatherer(loop, self.mesh, layout.dims, opt_state, micro)
                else:
                    rewrite = loop_exchange.rewriter(loop, self.mesh, layout.dims, opt_state)
                run = placement.value_and_grad(self.model, self.loss_fn, self.has_aux, rewrite)

                def exchange(*args):
                    # Which leaves the loss marks are Python bools, known at trace time: kept
                    # out of the traced result, whose last leaves must be the gradient's (the
                    # order the backward produces them is read from there).
                    outputs, grads, found, residuals = run(*args)
                    marked.append(tuple(found))
                    return (outputs, residuals), grads

            # Varying params: jax.grad of a replicated value would come back already summed
            # over the devices, through a hidden float32 all-reduce. (With marks the loss
            # varies them itself, all but the marked layers: ``value_and_grad_rows``.)
            varying = params if loop else make_varying(params, placement.manual_axes)
            traced = traced_gradient(exchange, varying, batch, *model_inputs)
            (outputs, grads), order, closed = traced
            outputs, residuals = outputs if loop else (outputs, None)
            placement.check_gradient(closed, params, layout.dims, self.algorithm)
            return outputs, grads, order, marked[0] if marked else (), residuals

        return gradient

    def _update(self, optimizer, grads, opt_state, params, order, layout, accumulating: bool,
                exchanged: tuple[bool, ...] = (), fed=None):  # fmt: skip
        """The optimizer's update of this device's (blocks of the) params, checked, in the
        placement's frame. ``exchanged``: the leaves the backward pass averaged already;
        ``fed``: their new error-feedback residuals, which take the place of the last of the
        state's (``loop_marks.fed_residuals``): the optimizer sees the others only."""
        placement, axes, dims = self.placement, self._axes, layout.dims
        sharded = placement.sharded(dims, accumulating, exchanged)
        extra = {"gradient_order": order, "sharded": sharded}

        def update(grads, opt_state, params, fed):
            own = placement.own(params, dims)
            fn = loop_marks.feeding(functools.partial(optimizer.update, **extra), fed)
            closed, (updates, opt_state) = traced(fn, grads, opt_state, own)
            placement.check_update(closed, self.algorithm)
            unsynced = checks.unsynced(updates, layout.updates, opt_state, layout.opt_state, axes)
            if unsynced:
                raise ValueError(
                    f"{self.algorithm}: the optimizer leaves updates or state that differ "
                    f"between devices ({', '.join(unsynced[:3])}); put jax_bytegrad.bytegrad() "
                    "or gradient_allreduce() first in the optax chain, or use "
                    "jax_bytegrad.qadam()"
                )
            return placement.finish(optax.apply_updates(own, updates), dims), opt_state

        fed_specs = jax.tree.map(lambda _: P(self._axes), fed)
        return placement.in_update_frame(
            update,
            (grads, opt_state, params, fed),
            (layout.params, layout.opt_state, layout.params, fed_specs),
            (layout.params, layout.opt_state),
        )

    def _metrics(self, loss, aux, model_state) -> tuple:
        axes = self.placement.manual_axes
        out = (jax.lax.pmean(loss, axes),)
        out += (jax.lax.pmean(aux, axes),) if self.has_aux else ()
        return out + ((model_state,) if self.model.has_state else ())

    def per_device(self, phase: str | None = None, params=None) -> Callable:
        """The un-jitted, un-mapped step of one device, for a ``shard_map`` of your own:
        ``(params, opt_state, batch) -> (params, opt_state, loss[, aux])``.

        ``loss`` (and ``aux``) are means over every device. ``phase`` picks the optimizer of
        a step with several; None for the only one. ``params`` (arrays or shapes) gives the
        layout of a step with ``shard=`` or accumulation. A step built with ``model_state=``
        or ``rng_seed=`` takes ``(params, opt_state, *model_inputs, batch)``, the model
        inputs being ``state.model_state``, then ``state.rng`` and the step count as uint32,
        and returns the synced model state last. A step that accumulates takes the
        accumulator (its row) and the micro-step's index (uint32) after ``opt_state`` and
        returns the new accumulator after the new ``opt_state``; its ``"accumulate"`` phase
        takes and returns no ``opt_state`` (but for ``shard="full"``, whose micro-steps
        exchange: it takes it first after the params, returns it first, and exchanges on the
        first optimizer's sync), and leaves the params as they are. With
        ``shard="params"`` the function is per node (``shard_map`` manual over the node
        axis only): use ``sharded``.
        """
        return self._per_device(self._phases.program(phase), self._layout_of(params, None))

    def _layout_of(self, params, opt_state) -> StateLayout:
        """``params``' layout; without them (a replicated step), the one ``opt_state`` gives."""
        if params is not None:
            return self._layout(params)
        if self.shard is not None or self.accumulation is not None:
            raise ValueError(
                f"{self.algorithm}: with shard= or accumulation, pass params=... (the params, "
                "or their shapes): they fix the layout"
            )
        specs = None if opt_state is None else self.placement.state_specs(opt_state, None)
        return StateLayout(None, None, P(), specs, None, None)

    def _per_device(self, phase, layout: StateLayout) -> Callable:
        accumulation = self.accumulation
        accumulating = accumulation is not None
        gradient = self._gradient(layout, gradient_phase(phase))
        placement, dims = self.placement, layout.dims

        def fold(acc, grads, micro):
            grads = placement.accumuland(grads, dims)
            return accumulation.fold(jax.tree.map(lambda a: a[0], acc), grads, micro)

        if accumulates(phase):
            # Only a micro-step that exchanges takes the optimizer state, for its keys and
            # error-feedback residuals, and returns it with the new residuals.
            exchanging = self._micro_exchange

            def accumulate(params, *rest):
                opt_state, rest = (rest[0], rest[1:]) if exchanging else (None, rest)
                acc, micro, *model_inputs, batch = rest
                (loss, aux, model_state), grads, *_, fed = gradient(
                    params, batch, *model_inputs, opt_state=opt_state, micro=micro
                )
                acc = jax.tree.map(lambda a: a[None], fold(acc, grads, micro))
                kept = (loop_marks.with_fed(opt_state, fed),) if exchanging else ()
                return (*kept, acc, *self._metrics(loss, aux, model_state))

            return accumulate
        optimizer = optax.with_extra_args_support(self._optimizers[phase])

        def step(params, opt_state, *rest):
            *inputs, batch = rest
            acc, micro, *model_inputs = inputs if accumulating else (None, None, *inputs)
            (loss, aux, model_state), grads, order, exchanged, fed = gradient(
                params, batch, *model_inputs, opt_state=opt_state, micro=micro
            )
            if accumulating:
                grads = optax.tree.cast_like(fold(acc, grads, micro), grads)
                acc = (jax.tree.map(jnp.zeros_like, acc),)
            params, opt_state = self._update(
                optimizer, grads, opt_state, params, order, layout, accumulating, exchanged, fed
            )
            return (params, opt_state, *(acc or ()), *self._metrics(loss, aux, model_state))

        return step

    def _specs_of(self, phase, layout: StateLayout) -> tuple[tuple, tuple]:
        """The global in and out specs of a phase's program, the batch's last."""
        params, specs = layout.params, layout.opt_state
        metrics = (P(),) * (1 + self.has_aux + self.model.has_state)
        model = (P(),) * self.model.num_inputs()
        if self.accumulation is None:
            return (params, specs, *model, P(self._axes)), (params, specs, *metrics)
        acc = layout.accumulated
        if accumulates(phase):
            state = (specs,) if self._micro_exchange else ()
            return (params, *state, acc, P(), *model, P(self._axes)), (*state, acc, *metrics)
        return (params, specs, acc, P(), *model, P(self._axes)), (params, specs, acc, *metrics)

    def sharded(self, opt_state, phase: str | None = None, params=None) -> Callable:
        """The step as one ``jax.shard_map`` over the mesh, not jitted: call it inside a
        ``jax.jit`` of your own. ``opt_state`` (or its ``jax.eval_shape``) gives the specs;
        with ``shard=`` or accumulation, pass ``params`` (or their shapes) too."""
        return self._mapped(self._phases.program(phase), self._layout_of(params, opt_state))

    def _mapped(self, phase: str, layout: StateLayout) -> Callable:
        in_specs, out_specs = self._specs_of(phase, layout)
        return self.placement.shard_map(self._per_device(phase, layout), in_specs, out_specs)

    def program(self, state: StepState) -> Program:
        _, phase = self._phase(int(state.step))
        key = (phase, self._layout(state.params).key)
        if key not in self._programs:
            self._programs[key] = self._build(key)
        return self._programs[key]

    def _build(self, key) -> Program:
        phase, layout = key[0], self._layouts[key[1]]
        in_specs, out_specs = self._specs_of(phase, layout)
        # The params (unless the phase leaves them as they are), the optimizer state, the
        # accumulator and the model state: the step returns their new values in their
        # buffers.
        if accumulates(phase):  # the accumulator (and state): the params stay as they are
            donated = (1, 2) if self._micro_exchange else (1,)
        else:
            donated = tuple(range(2 + (self.accumulation is not None)))
        model_state = len(in_specs) - 1 - self.model.num_inputs()
        donated += (model_state,) * self.model.has_state
        fn = jax.jit(
            self._mapped(phase, layout),
            compiler_options=self.placement.compiler_options(),
            in_shardings=self._shardings(in_specs),
            out_shardings=self._shardings(out_specs),
            donate_argnums=donated if self._donate else (),
        )
        inputs = functools.partial(self._inputs, phase=phase, layout=layout)
        outputs = functools.partial(self._outputs, phase=phase)
        return Program(fn, inputs, outputs)

    def _inputs(self, state, batch, *, phase, layout: StateLayout):
        # ``layout`` is the one ``program`` found for these params' shapes: not looked up again.
        rule.check_placed((state.params, state.opt_state), (layout.params, layout.opt_state),
                            self.mesh, f"{self.algorithm} (shard={self.shard!r})")  # fmt: skip
        batch = global_batch(batch, self.mesh, self._axes)
        model = self.model.inputs(state)
        if self.accumulation is None:
            return (state.params, state.opt_state, *model, batch)
        acc = state.extra[accumulation_lib.ACCUMULATED]
        micro = np.uint32(self.accumulation.position(int(state.step))[1])
        if accumulates(phase):
            kept = (state.opt_state,) if self._micro_exchange else ()
            return (state.params, *kept, acc, micro, *model, batch)
        return (state.params, state.opt_state, acc, micro, *model, batch)

    def _outputs(self, state, out, *, phase):
        out = list(out)
        if accumulates(phase):
            params = state.params
            opt_state = out.pop(0) if self._micro_exchange else state.opt_state
        else:
            params, opt_state = out.pop(0), out.pop(0)
        extra = {}
        if self.accumulation is not None:
            extra[accumulation_lib.ACCUMULATED] = out.pop(0)
        metrics = {"loss": out.pop(0)}
        if self.has_aux:
            metrics["aux"] = out.pop(0)
        extra.update(self.model.carried(state, out.pop(0) if self.model.has_state else None))
        return StepState(state.step, params, opt_state, extra), metrics


def data_parallel_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation
    | optax.MultiSteps
    | Mapping[str, optax.GradientTransformation],
    mesh: Mesh,
    *,
    has_aux: bool = False,
    donate: bool = True,
    node_axis: str = NODE_AXIS,
    local_axis: str = LOCAL_AXIS,
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
        (``qadam(phase=...)``'s two phases, for instance); or ``optax.MultiSteps(tx,
        every_k_schedule=k)`` to accumulate k micro-steps' gradients before each update, with
        one exchange between nodes per k micro-steps (``steps/accumulation.py``; its
        accumulator is ``state.extra["accumulated"]``).
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
        per device and per step (``step.device_key``) and replays after a restart. None: no key.
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
        ``hierarchical=True``. ``"full"``: the params and state split over every device,
        nodes included (FSDP's FULL_SHARD): the loss gets each layer gathered across nodes
        (as 8-bit codes with ``bytegrad`` and ``qadam``) where it marks it with
        ``exchange_in_loop``, the rest before the loss, and its gradient reduce-scattered
        across nodes; it needs the sync's settings, so build it with ``Strategy``. The
        optimizer after the sync must be elementwise (Adam, SGD, AdamW, Lion...), as it runs
        on blocks; docs/sharding.md.

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
    accumulation = None
    if isinstance(optimizer, optax.MultiSteps):
        optimizer, accumulation = Accumulation.of(optimizer, where)
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
        accumulation=accumulation,
    )
