"""A pipelined data-parallel ByteGrad step: the compressed sync's compute runs beside its wire.

Follows the bucketed, overlapped gradient sync of PyTorch DDP and Bagua (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020; Gan et al.,
"Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022), on XLA:CPU.

``data_parallel_step`` with ``optax.chain(bytegrad(...), optimizer)`` compiles one program.
XLA:CPU runs the collectives of a program one after another, each blocking, and overlaps
little compute with them, so that step takes the sum of its parts: the backward pass, the
codec's compute and the wire (benchmarks/RESULTS.md, "Line rate"). Two programs dispatched from
different threads do run at once (JAX uses the calling thread as the execution stream). So
this step cuts the same computation into programs at its collectives:

    grad            forward, backward, buckets (and the integer wire's block bounds)
    per bucket: its pieces of at most ``bucket_bytes`` (a leaf larger than that is cut too)
      integer wire: encode -> psum of the codes -> decode
      scatter-gather and ring wires: quantize -> all_to_all -> average -> all_gather -> decode
    update          the optimizer on the mean, and the new parameters

The programs that hold collectives (the wire programs) run on one dispatch thread of their
own, in the same order on every process and one at a time (Gloo tags every operation alike);
the others (the compute programs) on the caller's thread. Piece k's exchange is then on the
wire while piece k + 1 is encoded and piece k - 1 decoded: a software pipeline, each piece
one stage behind the one before it. A program of fewer than about 1000 flops (a collective
alone) runs inline on the thread that calls it, so the dispatch thread blocks in each
exchange while the caller's thread goes on.

The programs are built in ``stages.py``: each piece's are the stages of its wire's
plan (``wire.integer_stages``, ``wire.scatter_gather_stages``), the same functions the
one-program sync runs inline, with the same keys, so the step computes the same values as
``data_parallel_step`` with ``optax.chain(bytegrad(...), optimizer)``, bit for bit
(tests/test_pipelined.py), and holds the same ``StepState``: a checkpoint of one restores
into the other.

Where it overlaps: with one device per process (one JAX process per host, the layout of CPU
clusters and of benchmarks/network.py). A process with several devices runs every program
over all of its devices, one program at a time in dispatch order (XLA's PJRT CPU client
gang-schedules them), so there the programs run one after another, correct but not
overlapped. The backward pass is not overlapped with the sync: the gradient is one program.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks
from jax_bytegrad._src.algorithms.bytegrad.stages import (
    Stages,
    Whole,
    new_residuals,
    residual_names,
    residual_values,
)
from jax_bytegrad._src.mesh import StateSpecs
from jax_bytegrad._src.runtime.programs import (
    Dispatcher,
    LoweredPrograms,
    Schedule,
    Value,
    aval,
    execute,
)
from jax_bytegrad._src.steps.base import (
    Program,
    StepState,
    TrainStep,
    global_batch,
)
from jax_bytegrad._src.steps.data_parallel import DataParallelStep
from jax_bytegrad._src.sync.collectives import sends_nothing
from jax_bytegrad._src.sync.config import (
    Residuals,
    SyncConfig,
    plan_sync,
    platform_of,
    sync_config,
)
from jax_bytegrad._src.transforms import ByteGradState, sync_gradients


class _Chain(NamedTuple):
    """``optax.chain(sync, inner)`` by its parts, in its order: the transformations it
    chains (``optax.chain(*_Chain(...))``), and so the parts of its state
    (``_Chain(*opt_state)``), the one-program step's."""

    sync: Any  # bytegrad's: ByteGradState
    inner: Any  # the user's optimizer's


class _Inputs(NamedTuple):
    """What a step's programs are given besides the batch."""

    params: Any
    key: jax.Array
    inner: Any
    residuals: Residuals


def _named(inputs: _Inputs, batch) -> dict[Any, Any]:
    """The schedule's input values, by name."""
    return {
        Whole.PARAMS: inputs.params, Whole.KEY: inputs.key, Whole.INNER: inputs.inner,
        Whole.BATCH: batch, **residual_values(inputs.residuals),
    }  # fmt: skip


class _Outputs(NamedTuple):
    """What a step's programs give back. ``params`` last: ``StepsInFlight`` waits on the
    last leaf, one of the last program's."""

    loss: jax.Array
    aux: Any
    key: jax.Array
    residuals: Residuals
    inner: Any
    params: Any


def _schedule(sync: SyncConfig, mesh: Mesh, leaves, values: dict, specs: dict, *,
              average: bool, where: str, step=None, donate: bool = False) -> Schedule:  # fmt: skip
    """The programs of ``step`` (None: of the sync alone) for the gradient ``leaves``, built
    (traced, not compiled) from the inputs ``values``, each one's spec ``specs``' tree of
    specs, or one spec for every leaf (the sync's axes where it names none). The sync's plan
    is resolved as ``sync_mean`` resolves it inside the one-program step."""
    shape = sync.mesh_shape(mesh, where)
    weight = 1.0 / (shape[0] * shape[1]) if average else 1.0
    plan = plan_sync(sync, leaves, shape, platform_of(mesh), weight=weight)
    inputs = {}
    for name, value in values.items():
        spec = specs.get(name, P(sync.axes))
        if isinstance(spec, P):
            spec = jax.tree.map(lambda _, s=spec: s, value)
        inputs[name] = Value(spec, jax.tree.map(aval, value))
    programs = Stages(mesh, sync, plan, average=average, step=step).programs()
    return Schedule(programs, inputs, mesh, sync.axes, donate_state=donate)


class _Scheduled:
    """The program of a pipelined step: its schedule's programs, run and lowered as one.

    ``program(inputs, batch)`` runs one step (``execute``) and returns its ``_Outputs``.
    """

    def __init__(self, step: "PipelinedStep"):
        self._step = step

    def __call__(self, inputs: _Inputs, batch) -> _Outputs:
        schedule = self._step._schedule
        values = _named(inputs, batch)
        keep = [Whole.NEW_PARAMS, Whole.NEW_INNER, Whole.NEW_KEY, Whole.LOSS, Whole.AUX]
        keep += residual_names(schedule, inputs.residuals)
        values = execute(schedule, values, self._step._wire, keep)
        return _Outputs(
            loss=values[Whole.LOSS], aux=values.get(Whole.AUX), key=values[Whole.NEW_KEY],
            residuals=new_residuals(schedule, values, inputs.residuals),
            inner=values[Whole.NEW_INNER], params=values[Whole.NEW_PARAMS],
        )  # fmt: skip

    def lower(self, inputs: _Inputs, batch) -> LoweredPrograms:
        schedule = self._step._schedule
        return LoweredPrograms({
            task.name: task.jitted.lower(*[schedule.values[n].aval for n in task.input_names])
            for task in schedule.tasks
        })  # fmt: skip


class PipelinedStep(TrainStep):
    """The ``TrainStep`` of ``pipelined_step`` (see there): several programs per step, two
    threads. ``lower(state, batch)`` gives a ``LoweredPrograms`` (each program's ``Lowered``
    in ``.programs``, in dispatch order), whose collectives ``communication_stats`` sums as
    ``{"step": ...}``; on one node, the one-program step's ``jax.stages.Lowered``.
    """

    def __init__(self, algorithm, loss_fn, optimizer, mesh, *, sync, average, seed, has_aux,
                 donate, flatten):  # fmt: skip
        checks.transformation(optimizer, "optimizer", algorithm)
        sync = sync_config(sync, algorithm)
        checks.boolean(average, "average", algorithm)
        checks.integer(seed, "seed", algorithm, minimum=0)
        sync.mesh_shape(mesh, algorithm)
        super().__init__(
            algorithm, mesh, loss_fn, axes=sync.axes, has_aux=has_aux, flatten=flatten,
            donate=donate,
        )  # fmt: skip
        self.sync = sync
        self._optimizer = optimizer
        self._average = average
        # The state is the one-program step's (bytegrad's state, then the optimizer's), placed
        # as that step places it.
        chain = _Chain(sync_gradients(sync, average=average, mesh=mesh, seed=seed), optimizer)
        self._one_program = DataParallelStep(
            self.algorithm, self.loss_fn, {"step": optax.chain(*chain)}, lambda _: "step", mesh,
            has_aux=has_aux, donate=donate, axes=sync.axes, flatten=False,
        )  # fmt: skip
        self._state_step = self._one_program
        self._state_specs = StateSpecs(self._axes)
        self._schedule = None
        self._wire = Dispatcher(f"{self.algorithm}-wire")

    def program(self, state: StepState) -> Program:
        # On one node no codec runs beside a wire: the one-program step (pipelined_step).
        if sends_nothing(self.sync, self.mesh.shape[self.sync.node_axis]):
            return self._one_program.program(state)
        return super().program(state)

    def _build(self, key) -> Program:
        return Program(_Scheduled(self), self._inputs, self._outputs)

    def _inputs(self, state: StepState, batch) -> tuple[_Inputs, Any]:
        """The programs' inputs, and the batch (planning the schedule once)."""
        batch = global_batch(batch, self.mesh, self._axes)
        opt_state = _Chain(*state.opt_state)
        inputs = _Inputs(state.params, opt_state.sync.key, opt_state.inner,
                         opt_state.sync.residuals)  # fmt: skip
        if self._schedule is None:
            self._schedule = self._plan(state, inputs, batch)
        return inputs, batch

    def _plan(self, state: StepState, inputs: _Inputs, batch) -> Schedule:
        """The step's programs, built (traced, not compiled) from the abstract inputs."""
        specs = {
            Whole.PARAMS: P(), Whole.KEY: P(),
            Whole.INNER: _Chain(*self._state_specs(state.opt_state)).inner,
        }  # fmt: skip
        leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(state.params)]
        return _schedule(self.sync, self.mesh, leaves, _named(inputs, batch), specs,
                         average=self._average, where=self.algorithm, step=self,
                         donate=self._donate)  # fmt: skip

    def _outputs(self, state: StepState, out: _Outputs) -> tuple[StepState, dict[str, Any]]:
        opt_state = _Chain(ByteGradState(key=out.key, residuals=out.residuals), out.inner)
        metrics = {"loss": out.loss}
        if self.has_aux:
            metrics["aux"] = out.aux
        return StepState(state.step, out.params, tuple(opt_state), {}), metrics

    def close(self) -> None:
        """Stops the dispatch thread (after what it was given has run). Calling it again does
        nothing."""
        self._closed = True
        self._wire.close()


class PipelinedMean:
    """The sync alone, pipelined: ``compressed_mean`` of each device's own gradient, called
    outside ``jit`` (for benchmarks/network.py and the tests).

    ``mean(grads, key=None, residuals=None)``: ``grads`` a pytree of (devices, ...) arrays
    sharded over the config's axes, row i device i's gradient; ``key`` the replicated key of
    stochastic rounding; ``residuals`` error feedback's, as ``compressed_mean`` takes them
    stacked over the devices (not donated). Returns the mean, replicated (and the new
    residuals).
    """

    def __init__(self, mesh: Mesh, sync: SyncConfig, *, average: bool = True):
        self.mesh, self.sync, self.average = mesh, sync, average
        self._wire = Dispatcher("pipelined-mean-wire")
        self._schedule = None

    def __call__(self, grads, key=None, residuals=None):
        residuals = Residuals(() if residuals is None else residuals)
        values = {Whole.GRADS: grads, **({} if key is None else {Whole.KEY: key})}
        values.update(residual_values(residuals))
        if self._schedule is None:
            leaves = [jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in jax.tree.leaves(grads)]
            self._schedule = _schedule(self.sync, self.mesh, leaves, values, {Whole.KEY: P()},
                                       average=self.average, where="pipelined_step")  # fmt: skip
        schedule = self._schedule
        keep = [Whole.MEAN, *residual_names(schedule, residuals)]
        out = execute(schedule, values, self._wire, keep)
        mean = jax.tree.unflatten(jax.tree.structure(grads), out[Whole.MEAN])
        if not self.sync.error_feedback:
            return mean
        return mean, new_residuals(schedule, out, residuals)

    def close(self) -> None:
        self._wire.close()


# The builder ---------------------------------------------------------------------------------


def pipelined_step(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    sync: SyncConfig | None = None,
    average: bool = True,
    seed: int = 0,
    has_aux: bool = False,
    donate: bool = True,
    flatten: bool = False,
) -> PipelinedStep:
    """Builds a ByteGrad train step whose compressed sync runs its codec beside the wire.

    The same step as ``data_parallel_step(loss_fn, optax.chain(bytegrad(...), optimizer),
    mesh)``, bit for bit, with the same ``StepState``, cut into programs at the sync's
    collectives (module docstring): the wire programs run on a dispatch thread of the
    step's own, one at a time and in the same order on every process, while the caller's
    thread runs the codec of the pieces before and after. Each bucket crosses the wire in
    pieces of at most ``sync.bucket_bytes`` of float32 (a leaf larger than that is cut too),
    so a smaller bucket overlaps more and pays more exchanges. ``step(state, batch)``
    returns once the step's last exchange has finished (the update may still be computing).
    Use it as a context manager, or call ``close()``, to stop the thread.

    It overlaps where each process has one device (one process per host); see the module
    docstring. On one node (``hierarchical=True``), where nothing crosses between nodes, it
    is the one-program step, whose sync is ``gradient_allreduce``'s one all-reduce.
    ``Strategy("bytegrad", pipeline=True)`` builds it.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``),
        computed on one device's slice of the batch.
      optimizer: the optax optimizer applied to the mean gradient (``optax.adam(1e-3)``).
      mesh: from ``make_mesh``.
      sync: the compressed sync's settings (``SyncConfig``, both wires, error feedback and
        stochastic rounding included); None for the defaults.
      average: divide the sum by the device count (default), as ``bytegrad``'s.
      seed: seeds the PRNG key of stochastic rounding, as ``bytegrad``'s.
      has_aux, donate, flatten: as for ``data_parallel_step`` (the update program donates).

    Returns:
      A ``PipelinedStep`` (a ``TrainStep``): ``init``, ``step``, ``params``, ``lower`` (a
      ``LoweredPrograms``: one ``Lowered`` per program, by name, in ``.programs``),
      ``communication_stats``, ``phase_counts``, ``close``.

    Raises:
      ValueError: for a bad argument, or a mesh that lacks the config's axes.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> loss_fn = lambda w, b: jnp.mean((b * w) ** 2)
      >>> with jax_bytegrad.pipelined_step(loss_fn, optax.sgd(0.1), mesh) as step:
      ...     state = step.init(jnp.ones(4))
      ...     state, metrics = step(state, jnp.ones((8, 4)))
      >>> float(metrics["loss"]), int(state.step)
      (1.0, 1)

    References:
      Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
      VLDB 2020.
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """
    return PipelinedStep(
        "pipelined_step",
        loss_fn,
        optimizer,
        mesh,
        sync=sync,
        average=average,
        seed=seed,
        has_aux=has_aux,
        donate=donate,
        flatten=flatten,
    )
