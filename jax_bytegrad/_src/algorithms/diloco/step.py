"""DiLoCo and streaming DiLoCo: nodes train alone for H steps, then average compressed
pseudo-gradients.

Follows Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(2023), and its streaming form (Douillard et al., "Streaming DiLoCo with overlapping
communication", 2025). Per device, inside ``jax.shard_map`` on a ("node", "local") mesh:

    inner step (every step):  g = mean over "local" of grad f(x)     (float32, within the node)
                              x = x + inner_optimizer(g)
    outer step (fragment p, every H steps, staggered by H / F):
                              delta = global_p - x_p                  (the pseudo-gradient)
                              mean = mean over nodes of delta         (8- or 4-bit codes)
                              global_p = global_p + outer_optimizer(mean)
                              x_p = global_p                          (every node restarts)

Nothing crosses between nodes in an inner step. The outer exchange is ``sync_mean``, the
compressed wire of ``bytegrad`` with its error feedback (the residuals are carried from one
outer step to the next), or a float32 ``full_precision_mean`` with ``bits=32``. Every device
decodes the same codes and runs the same outer update, so the global params are bit-identical
everywhere.

The params are split into F fragments, as even in bytes as possible (sets of whole leaves, or
with more fragments than leaves runs of rows: a scanned stack's layers), each exchanged every
H steps, staggered by H / F; which step's program carries which exchange is ``schedule.py``'s.
With ``delay=0`` an exchange runs in the step that ends its H steps, after the inner update
(exact). With ``delay`` tau >= 1 it runs inside the next steps' programs, from their inputs (in
tau chunks of rows, one a step, whose means wait in the state for the last): nothing in the
inner update waits for it, so XLA can schedule it beside the compute (on GPU; XLA:CPU runs a
program's collectives one after another), and the fragment lands tau steps late, restarting
from the new global params plus the node's own steps since the exchange started. With
``background=True`` the exchange is a program of its own instead, run by a thread of the
step's beside the next tau inner steps (``exchange.py``, where the exchanges and the outer
step live).

The state: ``state.params`` holds each node's params (stacked on a leading axis of the node
count, sharded over "node"), ``state.opt_state`` each node's inner optimizer state laid out
the same way, and ``state.extra`` the global params, the outer optimizer state of each
fragment, with error feedback each chunk's residuals, with ``delay`` > 1 the exchanges in
flight (each node's params when its exchange started, and the means received), and in the
background what each fragment's exchange lands, per node. The fragment
schedule follows from ``state.step``, so a checkpoint of the state resumes bit-exact. With
``shard=`` the data-parallel step's placement objects (``sharding/placement.py``) split the
node's state within the node, the global params and outer state with it
(``sharding/diloco.py``): each device runs the inner and outer updates on its blocks.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks
from jax_bytegrad._src.algorithms.diloco.estimate import FLOAT32
from jax_bytegrad._src.algorithms.diloco.exchange import Exchanges
from jax_bytegrad._src.algorithms.diloco.schedule import INNER, Schedule
from jax_bytegrad._src.axes import LOCAL_AXIS, NODE_AXIS
from jax_bytegrad._src.codecs.widths import BITS
from jax_bytegrad._src.mesh import replicate
from jax_bytegrad._src.runtime.programs import Dispatcher
from jax_bytegrad._src.sharding import rule
from jax_bytegrad._src.sharding.diloco import (
    GLOBAL,
    LANDING,
    OUTER,
    RECEIVED,
    RESIDUALS,
    STARTED,
    DiLoCoLayout,
    diloco_layout,
    fragment,
    merged,
)
from jax_bytegrad._src.sharding.placement import check_shard, placement_of
from jax_bytegrad._src.sharding.rule import Shard
from jax_bytegrad._src.steps.base import (
    Program,
    StepState,
    TrainStep,
    count,
    device_mean,
    global_batch,
    host_copy,
    process_mean,
)
from jax_bytegrad._src.steps.model_state import ModelState
from jax_bytegrad._src.steps.tracing import traced
from jax_bytegrad._src.sync.collectives import mesh_residuals
from jax_bytegrad._src.sync.config import (
    DEFAULT_MESSAGE_BYTES,
    BucketBytes,
    SyncConfig,
    Wire,
    platform_of,
)
from jax_bytegrad._src.sync.patterns import make_varying

# Private helpers -------------------------------------------------------------------------


def default_outer_optimizer() -> optax.GradientTransformation:
    """The outer optimizer: Nesterov SGD, learning rate 0.7, momentum 0.6 (gain 1.75), the
    outer step measured best across H = 1 to 100 on the byte language model and the tabular
    task (benchmarks/RESULTS.md, "One outer step for both tasks"). DiLoCo's paper uses
    momentum 0.9 (gain 7), tuned for H in the hundreds over long runs."""
    return optax.sgd(0.7, momentum=0.6, nesterov=True)


def _check(mesh, axes, inner_steps, fragments, delay, background, outer_optimizer, bits,
           where) -> None:  # fmt: skip
    """Raises a ``ValueError`` naming the bad setting and what to do."""
    nodes, _ = checks.mesh_axes(mesh, *axes, where)
    if nodes < 2:
        raise ValueError(
            f"{where}: the mesh has one node along {axes[0]!r}, and DiLoCo averages between "
            "nodes; use a mesh of several nodes (make_mesh(num_nodes, devices_per_node)), or "
            "Strategy('gradient_allreduce') within one node"
        )
    h = checks.integer(inner_steps, "inner_steps", where, why=" (H: inner steps per outer step)")
    f = checks.integer(fragments, "fragments", where, why=" (F: params fragments)")
    if h % f:
        raise ValueError(
            f"{where}: fragments={f} does not divide inner_steps={h}; the fragments are "
            f"staggered by inner_steps / fragments steps: pick F among the divisors of {h}"
        )
    checks.integer(delay, "delay", where, minimum=0, why=" (tau: the steps an exchange takes)")
    checks.boolean(background, "background", where)
    if background and delay < 1:
        raise ValueError(
            f"{where}: background=True runs each exchange beside the next `delay` inner steps "
            "and lands it in the last of them: use delay >= 1 (delay=0 is the exact exchange, "
            "inside its own step)"
        )
    if background and platform_of(mesh) != "cpu":
        raise ValueError(
            f"{where}: background=True is for CPU hosts, where XLA runs a program's collectives "
            f"blocking; on {platform_of(mesh)} use background=False: the exchange inside the "
            "next steps' programs (delay=), which XLA overlaps with their compute"
        )
    if delay >= h:
        raise ValueError(
            f"{where}: delay={delay} must be less than inner_steps={h} (an exchange must land "
            f"before its fragment's next one starts); use delay <= {h - 1}"
        )
    example = "optax.sgd(0.7, momentum=0.6, nesterov=True)"
    checks.transformation(outer_optimizer, "outer_optimizer", where, example)
    checks.one_of(bits, (*BITS, FLOAT32), "bits", where)


class _DiLoCo(Exchanges, TrainStep):
    """``diloco_step``'s ``TrainStep``: one program for inner steps, one per fragment for the
    steps that exchange it."""

    def __init__(self, loss_fn, optimizer, outer, mesh, *, axes, inner_steps, fragments,
                 delay, background, sync, has_aux, donate, flatten, model, shard):  # fmt: skip
        super().__init__("diloco", mesh, loss_fn, axes=axes, has_aux=has_aux,
                         flatten=flatten, donate=donate, model=model)  # fmt: skip
        self.optimizer, self.outer = optimizer, outer
        self.inner_steps, self.fragments, self.delay = inner_steps, fragments, delay
        self.sync = sync  # None: a float32 exchange
        self.background = background
        self.schedule = Schedule(inner_steps, fragments, delay, background)
        # What an exchange reads and writes (in the background, its own program), then the
        # exchanges in flight and what lands.
        self._exchanged_keys = (GLOBAL, OUTER) + ((RESIDUALS,) if self._feedback else ())
        self._extra_keys = self._exchanged_keys + ((STARTED, RECEIVED) if self._pending else ())
        self._extra_keys += (LANDING,) if background else ()
        self._dispatcher = Dispatcher("diloco-exchange") if background else None
        self.phases = self.schedule.phases
        self._treedef = None
        self.shard = shard
        self.placement = placement_of(shard, mesh, axes)
        self._layout: DiLoCoLayout | None = None  # the state's specs and fragments, at first init

    @property
    def _feedback(self) -> bool:
        return self.sync is not None and self.sync.error_feedback

    @property
    def _pending(self) -> bool:
        """Whether chunks of exchanges stay in flight between steps (``delay`` > 1, not in
        the background)."""
        return self.schedule.chunks > 1

    def _phase(self, steps_taken: int) -> tuple[str, Any]:
        return self.schedule.phase(steps_taken)

    # Where the state lives. ---------------------------------------------------------------

    def _plan(self, params) -> None:
        """Splits ``params`` into fragments and lays out the state, once."""
        layout = diloco_layout(self.placement, self.optimizer, self.outer, params, self.fragments,
                               self._feedback, self.schedule.chunks, self.background)  # fmt: skip
        if self._layout is not None and layout.fragments != self._layout.fragments:
            raise ValueError(
                "diloco: this step split the params of its first init into fragments, and "
                "these params have other leaves; build a new step for them"
            )
        self._layout, self._treedef = layout, jax.tree.structure(params)

    def _fragment(self, tree, f: int):
        """``tree`` cut to fragment ``f``'s pieces, the leaves outside it None (optax skips
        them)."""
        return fragment(tree, self._layout.fragments[f])

    def _merged(self, tree, fragment_tree, f: int):
        """``tree`` with fragment ``f``'s pieces taken from ``fragment_tree``."""
        return merged(tree, fragment_tree, self._layout.fragments[f])

    def _shardings(self, specs=None):
        """``specs`` (default: the state's) as shardings on the mesh."""
        if specs is None:
            specs = (*self._layout.stacked(self._axes), self._layout.extra)
        named = lambda spec: NamedSharding(self.mesh, spec)  # noqa: E731
        return jax.tree.map(named, specs, is_leaf=lambda x: isinstance(x, P))

    def _place(self):
        """The jitted ``global params -> (node params, inner state, extra)``."""
        nodes, platform = int(self.mesh.shape[self._axes[0]]), platform_of(self.mesh)
        shape = (nodes, int(self.mesh.shape[self._axes[1]]))

        def place(params):
            stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (nodes, *x.shape)), params)
            frags = [self._fragment(params, f) for f in range(self.fragments)]
            extra = {
                GLOBAL: jax.tree.map(jnp.copy, params),  # a buffer of its own, to donate
                OUTER: tuple(self.outer.init(p) for p in frags),
            }
            leaves, layout = jax.tree.leaves(params), self._layout
            chunks = [[p.of(leaves) for p in layout.chunks[f][k]] for f, k in layout.slots]
            if self._feedback:
                extra[RESIDUALS] = tuple(
                    mesh_residuals(c, self.sync, shape, platform) for c in chunks
                )
            if self._pending:  # nothing in flight yet; each exchange writes before it reads
                extra[STARTED] = jax.tree.map(jnp.zeros_like, stacked)
                extra[RECEIVED] = tuple(tuple(jnp.zeros_like(x) for x in c) for c in chunks)
            if self.background:  # nothing lands before an exchange has written it
                pieces = [[p.of(leaves) for p in m] for m in layout.fragments]
                zeros = lambda x: jnp.zeros((nodes, *x.shape), x.dtype)  # noqa: E731
                extra[LANDING] = tuple(tuple(zeros(x) for x in m) for m in pieces)
            return stacked, jax.vmap(self.optimizer.init)(stacked), extra

        return jax.jit(place, out_shardings=self._shardings())

    def _init(self, params) -> StepState:
        self._plan(params)
        params = replicate(host_copy(params), self.mesh)
        return StepState(count(0), *self._place()(params))

    def _state_shapes(self, params) -> StepState:
        self._plan(params)
        replicated = NamedSharding(self.mesh, P())
        params = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), params
        )
        return StepState(count(0), *self._place().eval_shape(params))

    def _expected_opt_state(self, params):
        return jax.eval_shape(jax.vmap(self.optimizer.init), params)

    def _params(self, state: StepState):
        return state.extra[GLOBAL]

    # The programs. ------------------------------------------------------------------------

    def _inner(self, grads, opt_state, own):
        """The inner optimizer's update of this device's params ``own`` from the node's mean
        gradient: the new params and inner state."""
        # Over the state's own leading axis (this node's row), as jax.vmap: the optimizer
        # sees each leaf as it is, and XLA:CPU updates a donated buffer in place; through
        # the row's slice it copies every param and moment first (RESULTS.md, "DiLoCo").
        rows = jax.tree.map(lambda x: x[None], (grads, opt_state, own))
        closed, (updates, state) = traced(jax.vmap(self.optimizer.update), *rows)
        self.placement.check_update(closed, "diloco (the inner optimizer)")
        new = optax.apply_updates(rows[2], updates)
        return jax.tree.map(lambda x: x[0], (new, state))

    def _build(self, key) -> Program:
        if self.background and key != INNER:
            return self._build_background(key)
        inner = key == INNER
        # The outer state, as the update frame and the state hold it: an inner step's not.
        extra = () if inner else ((self._layout.extra,) * 2,)
        update = functools.partial(self._update, None if inner else key)
        fn = self._step_fn(update, extra, extra, rows=False, donated=2 + len(extra))
        keys = () if inner else self._extra_keys
        return Program(fn, self._inputs(keys=keys), self._outputs(given=not inner))

    def _step_fn(self, update, held, given, *, rows: bool, donated: int):
        """A step's program: ``(params, opt_state, *held trees, *model inputs, batch) ->
        (params, opt_state, *given trees, *losses)``. The loss's gradient, then
        ``update(grads, opt_state, params, *held)`` in the placement's update frame, which
        gives the ``given`` trees besides. ``held`` and ``given``: each tree's specs in the
        update frame and as the state keeps it; ``rows``: whether they carry the node's row,
        as params do (else as they are: the outer state). Its first ``donated`` arguments
        donated."""
        placement, layout, n_held = self.placement, self._layout, len(held)
        row = lambda tree: jax.tree.map(lambda x: x[0], tree)  # noqa: E731
        unrow = lambda tree: jax.tree.map(lambda x: x[None], tree)  # noqa: E731
        update_in = (layout.params, layout.opt_state, layout.params, *(f for f, _ in held))
        update_out = (layout.params, layout.opt_state, *(f for f, _ in given))

        def per_device(params, opt_state, *rest):
            trees, inputs, batch = rest[:n_held], rest[n_held:-1], rest[-1]
            params, opt_state = row((params, opt_state))
            trees = row(trees) if rows else trees
            grad_fn = placement.value_and_grad(self.model, self.loss_fn, self.has_aux)
            # Varying first: else jax.grad would sum the gradient over the node itself.
            varying = make_varying(params, placement.manual_axes)
            (loss, aux, _), grads = grad_fn(varying, batch, *inputs)
            params, opt_state, *out = placement.in_update_frame(
                update, (grads, opt_state, params, *trees), update_in, update_out
            )
            metrics = (loss, aux) if self.has_aux else (loss,)
            out = unrow(out) if rows else out
            return (*unrow((params, opt_state)), *out, *unrow(metrics))

        state = layout.stacked(self._axes)
        metrics = (P(tuple(placement.manual_axes)),) * (2 if self.has_aux else 1)
        model = (P(),) * self.model.num_inputs()
        in_specs = (*state, *(s for _, s in held), *model, P(self._axes))
        out_specs = (*state, *(s for _, s in given), *metrics)
        return self._jit(per_device, in_specs, out_specs, donated)

    def _jit(self, per_device, in_specs, out_specs, donated: int):
        """``per_device`` mapped over the mesh and jitted, its first ``donated`` arguments
        donated (when the step donates)."""
        return jax.jit(
            self.placement.shard_map(per_device, in_specs=in_specs, out_specs=out_specs),
            compiler_options=self.placement.compiler_options(),
            # The state comes back as it went in: a residual of error feedback's integer wire
            # is empty, and the shard_map alone would hand it back replicated, which the next
            # exchange would compile again for.
            out_shardings=self._shardings(out_specs),
            donate_argnums=tuple(range(donated)) if self._donate else (),
        )

    def _metrics(self, out) -> dict[str, Any]:
        """The step's metrics from its per-device losses (and aux) ``out``: their mean over
        every device; in the background over this process's devices (its node's, with a
        process per node), since a mean between processes would be a collective on the
        caller's thread beside the exchange's on the dispatch thread, which Gloo cannot tell
        apart."""
        mean = process_mean if self.background else device_mean
        metrics = {"loss": mean(out[0])}
        if self.has_aux:
            metrics["aux"] = mean(out[1])
        return metrics

    def close(self) -> None:
        if self._dispatcher is not None:
            self._dispatcher.close()
        super().close()

    def _inputs(self, land=(), keys=()):
        """``(state, batch) ->`` a step's arguments: the state, what each fragment of
        ``land`` lands (in the background), ``state.extra``'s ``keys`` as one tree (none: no
        tree), the model's inputs and the batch over the mesh. A state placed otherwise than
        the step keeps it (restored onto the bare mesh, say) is refused, naming
        state_shapes, as the data-parallel step refuses it."""

        def inputs(state, batch):
            rule.check_placed((state.params, state.opt_state), self._layout.stacked(self._axes),
                                self.mesh, "diloco")  # fmt: skip
            landing = tuple(state.extra[LANDING][f] for f in land)
            extra = ({k: state.extra[k] for k in keys},) if keys else ()
            return (state.params, state.opt_state, *landing, *extra, *self.model.inputs(state),
                    global_batch(batch, self.mesh, self._axes))  # fmt: skip

        return inputs

    def _outputs(self, given: bool = False, start: int | None = None):
        """``(state, out) -> (state, metrics)`` from a step's ``(params, opt_state, *given,
        *losses)``: ``given`` an outer step's new ``extra``; with ``start`` (the fragment whose
        exchange the step started in the background), the copy it started from, and ``out``
        is ``(the exchange's new extra and landing, that)``."""

        def outputs(state, out):
            exchanged, out = out if start is not None else (None, out)
            params, opt_state, *out = out
            extra = {**state.extra, **(out.pop(0) if given else {})}
            if exchanged is not None:
                out.pop(0)  # the copy the exchange started from
                extra.update(exchanged[0])
                lands = enumerate(extra[LANDING])
                extra[LANDING] = tuple(exchanged[1] if f == start else x for f, x in lands)
            return StepState(state.step, params, opt_state, extra), self._metrics(out)

        return outputs

    # Bytes between nodes. -----------------------------------------------------------------

    def bytes_between_nodes(self, state: StepState, batch) -> dict[str, float]:
        """Bytes each device sends over the links between nodes, per phase and per inner step
        on average; compiles, runs nothing.

        Read from each phase's compiled program (``communication_stats``, ``bytes_on`` the
        node axis). One period of ``inner_steps`` steps exchanges each fragment once (in
        ``delay`` steps when ``delay`` > 1), so the average is the sum of the period's
        phases over H. Multiply by the devices per node for what a node sends.

        Returns:
          ``{phase: bytes}`` for the phases of ``communication_stats`` (``"inner"``,
          ``"outer"`` or ``"outer_0"``...), and ``"per_inner_step"``: the average.
        """
        per_phase = super().bytes_between_nodes(state, batch)
        total = sum(per_phase[self._phase(s)[0]] for s in self.schedule.period())
        return {**per_phase, "per_inner_step": total / self.inner_steps}


# The public factory ----------------------------------------------------------------------


def diloco_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    inner_steps: int,
    fragments: int = 1,
    delay: int = 1,
    background: bool = False,
    outer_optimizer: optax.GradientTransformation | None = None,
    bits: int = 8,
    error_feedback: bool = False,
    block_size: int | None = None,
    wire: Wire = "auto",
    bucket_bytes: BucketBytes = "auto",
    message_bytes: int | None = DEFAULT_MESSAGE_BYTES,
    has_aux: bool = False,
    donate: bool = True,
    node_axis: str = NODE_AXIS,
    local_axis: str = LOCAL_AXIS,
    flatten: bool = False,
    shard: Shard | None = None,
    model_state: Any = None,
    rng_seed: int | None = None,
    state_sync: str = "mean",
) -> TrainStep:
    """Builds a DiLoCo train step: H inner steps within each node, then a compressed outer step.

    Each node trains with ``optimizer`` on its devices' slices of the batch, averaging the
    gradient over its own devices only (float32). Every ``inner_steps`` steps the nodes
    average the pseudo-gradient (global params minus the node's) on the compressed wire of
    ``bytegrad`` (``bits`` 8, 4 or 2, with ``error_feedback`` residuals carried from one outer
    step to the next; ``bits=32`` for float32), ``outer_optimizer`` updates the global params,
    and every node restarts from them. With ``fragments`` F > 1 (streaming DiLoCo) the params
    are split into F fragments (sets of whole leaves, or with more fragments than leaves runs
    of rows: a scanned stack's layers), each exchanged every ``inner_steps`` steps,
    staggered by ``inner_steps / F``. See docs/diloco.md.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), on one device's slice.
      optimizer: the inner optimizer (DiLoCo's: AdamW), one per node.
      mesh: from ``make_mesh``, with at least two nodes.
      inner_steps: H, the inner steps per outer step of each fragment.
      fragments: F, how many fragments of the params are exchanged at staggered steps; it
        divides ``inner_steps``.
      delay: tau, from 0 to ``inner_steps - 1``. 0: a fragment's exchange runs in the
        program of the step that ends its H inner steps, after that step's update (exact).
        1 (default): it runs inside the next step's program, beside that step's compute, and
        lands one step late (the fragment restarts from the new global params plus that
        step's own update). tau > 1: the fragment is split into tau chunks of rows, as even
        in bytes as the rows allow, one exchanged inside each of the next tau steps, and
        the fragment lands tau steps late (plus the node's own tau steps); the state then
        keeps the exchanges in flight, two params' worth more (split as the global params
        with ``shard=``).
      background: run each exchange as a program of its own, on a thread of its own, beside
        the next ``delay`` inner steps (tau >= 1, whole: no chunks), and land it in the last
        of them as above. For CPU hosts with one device per process, where XLA:CPU runs a
        program's collectives blocking: two programs from different threads run at once.
        The state keeps one params' worth more per node (what each fragment lands). With
        several devices per process the programs run one at a time (correct, no overlap);
        refused on GPUs, where the exchange inside a step (the default) is what XLA overlaps.
      outer_optimizer: any optax transformation of the pseudo-gradient; None for Nesterov SGD
        at learning rate 0.7, momentum 0.6 (measured best for H = 1 to 100; DiLoCo's paper
        uses momentum 0.9, for H in the hundreds). Each fragment keeps its own state.
      bits: 8, 4 or 2 (codes between nodes, as ``bytegrad``; 2 on the scatter-gather
        wire), or 32 (a float32 exchange).
      error_feedback: keep what each device's compressions left unsent and add it to the
        next outer step's pseudo-gradient (recommended at 4 bits, and at 2).
      block_size, wire, bucket_bytes, message_bytes: the wire's settings, as ``bytegrad``'s.
      has_aux, donate, node_axis, local_axis: as for ``data_parallel_step``.
      flatten: keep the params as one vector (then one fragment).
      shard: None (every device holds its node's whole state), ``"optimizer"`` (the inner
        optimizer state, the global params and the outer state split over the node's
        devices; the node's params whole) or ``"params"`` (the node's params split too),
        as ``data_parallel_step``'s. The inner and outer optimizers must then be elementwise.
      model_state: not supported (refused): its sync would cross between nodes every step.
      rng_seed: the loss function also gets ``key=``, different per device and step, as
        for ``data_parallel_step``.
      state_sync: unused without ``model_state``.

    Returns:
      A ``TrainStep``. ``step.params(state)`` is the global params (replicated);
      ``state.params`` holds each node's (stacked over nodes). ``metrics["loss"]`` is the
      mean over devices of each device's loss before its update. ``bytes_between_nodes``
      gives the traffic per phase and per inner step.

    Raises:
      ValueError: at build time for ``inner_steps < 1``, ``fragments`` that does not divide
        ``inner_steps``, ``delay`` below 0 or not below ``inner_steps``, ``background`` with
        ``delay=0`` or on GPUs, an
        ``outer_optimizer`` that is not an optax transformation, a mesh of one node, a bad
        wire setting, or ``model_state``; at ``init``, for more fragments than the params'
        rows can share.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> from jax_bytegrad._src.algorithms.diloco.step import diloco_step
      >>> mesh = jax_bytegrad.make_mesh(2, 1)
      >>> step = diloco_step(lambda w, b: jnp.mean((b * w) ** 2), optax.sgd(0.1), mesh,
      ...                    inner_steps=2, delay=0)
      >>> state = step.init(jnp.ones(4))
      >>> for _ in range(2):
      ...     state, metrics = step(state, jnp.ones((8, 4)))
      >>> [step.phase_counts(state)[p] for p in step.phases]
      [1, 1]

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
      2023. Douillard et al., "Streaming DiLoCo with overlapping communication: Towards a
      Distributed Free Lunch", 2025.
    """
    where = "diloco_step"
    outer = default_outer_optimizer() if outer_optimizer is None else outer_optimizer
    axes = (node_axis, local_axis)
    _check(mesh, axes, inner_steps, fragments, delay, background, outer, bits, where)
    check_shard(shard, flatten, where, per_node=True)
    model = ModelState.of(model_state, rng_seed, state_sync, where)
    if model.has_state:
        raise ValueError(
            f"{where}: model_state= is not supported (its sync would cross between nodes every "
            "step, and the nodes train apart); keep BatchNorm statistics out of the model or "
            "use bytegrad. rng_seed= (per-device keys) is supported"
        )
    sync = None
    if bits != FLOAT32:
        sync = SyncConfig(
            node_axis=node_axis, local_axis=local_axis, bits=bits, block_size=block_size,
            bucket_bytes=bucket_bytes, message_bytes=message_bytes,
            error_feedback=error_feedback, wire=wire, where=where,
        )  # fmt: skip
        sync.mesh_shape(mesh, where)
    elif error_feedback:
        coded = " or ".join(map(str, BITS))
        raise ValueError(f"{where}: error_feedback=True needs bits={coded}; bits=32 loses nothing")
    return _DiLoCo(
        loss_fn, optimizer, outer, mesh, axes=axes, inner_steps=inner_steps,
        fragments=fragments, delay=delay, background=background, sync=sync, has_aux=has_aux,
        donate=donate, flatten=flatten, model=model, shard=shard,
    )  # fmt: skip


def check_settings(mesh: Mesh, settings: dict[str, Any], flatten: bool = False) -> None:
    """Validates ``Strategy("diloco", ...)``'s settings when it is built, as ``diloco_step``
    does; raises its ``ValueError``."""
    diloco_step(lambda params, batch: 0.0, optax.identity(), mesh, flatten=flatten, **settings)
