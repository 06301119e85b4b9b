"""Asynchronous model averaging across JAX processes, with a background thread.

Follows Bagua's ``AsyncModelAverageAlgorithm`` (Gan et al., "Bagua: Scaling up Distributed
Learning with System Relaxations", VLDB 2022), after asynchronous decentralized SGD (Lian
et al., "Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML 2018).

Each process (a node of the mesh) trains on its own: gradients are averaged only over its
own devices, never between processes. A background thread in every process averages the
model over all processes every ``sync_interval_ms``, keeping the local updates made while
the averaging was in flight:

    s = snapshot of x;   m = mean over processes of s   (collective, in the thread)
    x <- x + (m - s)                                     (at the next train step)

Concurrency finding (tested with two processes, ``tests/test_async_averaging.py``): on CPU
with Gloo, a cross-process collective program launched from a second Python thread runs
while the main thread keeps executing local train steps; nothing serializes or deadlocks,
because only the averaging thread ever issues cross-process collectives, so every process
issues them in the same order. Stopping is the delicate part: a thread that leaves the loop
while its peers enter another round would hang them. Every round therefore also reduces a
stop flag (a max over processes), so all threads leave after the same round. NCCL (GPU) was
not tested across processes here.
"""

import atexit
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks
from jax_bytegrad._src.axes import LOCAL_AXIS, NODE_AXIS
from jax_bytegrad._src.inspection import stats
from jax_bytegrad._src.mesh import replicate
from jax_bytegrad._src.steps.base import Program, StepState, TrainStep, host_copy
from jax_bytegrad._src.steps.data_parallel import DataParallelStep
from jax_bytegrad._src.sync.buckets import flatten_float32, unflatten_like
from jax_bytegrad._src.transforms import gradient_allreduce

# Private helpers -------------------------------------------------------------------------

# The averagers still running; one exit hook stops them all, so that no process leaves its
# peers waiting in a collective when the interpreter exits.
_RUNNING: "weakref.WeakSet[_Averager]" = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for averager in list(_RUNNING):
        averager.stop(timeout=averager.exit_timeout)


def _process_count(mesh: Mesh) -> int:
    return len({d.process_index for d in mesh.devices.flat})


class AsyncModelAverageState(NamedTuple):
    """What ``AsyncModelAverage.round_stats`` reports.

    Attributes:
      rounds: averaging rounds completed by this process's thread since construction.
      last_round_ms: wall time of the latest round's collective, in milliseconds.
      running: whether the background thread is running.
    """

    rounds: int
    last_round_ms: float
    running: bool


class _Averager:
    """The averaging between processes: a snapshot of the model, a thread, pending deltas.

    A round averages the latest published snapshot ``s`` over processes on one device per
    process and adds ``mean(s) - s`` to the pending delta, which ``take`` hands to the next
    train step. Only this object issues cross-process collectives.
    """

    def __init__(self, mesh: Mesh, node_axis: str, sync_interval_ms: int, exit_timeout: float):
        self.sync_interval_ms = sync_interval_ms
        self.exit_timeout = exit_timeout
        # The mesh's processes: jax.process_count(), or a deviceless mesh's hosts.
        self._nproc = _process_count(mesh)
        # One device per process does the averaging: a float32 all-reduce of the whole model.
        # Its axis carries the node axis's name: each process is one node.
        devices = sorted(mesh.devices.flat, key=lambda d: d.id)
        firsts = [next(d for d in devices if d.process_index == p) for p in range(self._nproc)]
        avg_mesh = Mesh(np.array(firsts, dtype=object), (node_axis,))
        self._my_device = firsts[jax.process_index()]
        self._row_sharding = NamedSharding(avg_mesh, P(node_axis))

        def body(flat, flag):
            mean = jax.lax.pmean(flat, node_axis)
            return mean - flat, jax.lax.pmax(flag, node_axis)

        self._program = jax.jit(
            jax.shard_map(
                body,
                mesh=avg_mesh,
                in_specs=(P(node_axis), P(node_axis)),
                out_specs=(P(node_axis), P()),
            )
        )
        self._lock = threading.Lock()
        self._snapshot = None  # flat float32 params as of the latest step, on _my_device
        self._pending = None  # mean(s) - s not yet added to the params
        self._stop_requested = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._rounds = 0
        self._last_ms = 0.0

    @property
    def running(self) -> bool:
        return self._thread is not None

    def publish(self, params) -> None:
        """Makes ``params`` the snapshot the next round averages."""
        flat = jax.device_put(flatten_float32(params), self._my_device)
        with self._lock:
            self._snapshot = flat

    def take(self):
        """The finished rounds' flat ``mean(s) - s`` (None if none), now owed to the params."""
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is not None:
                # The params now hold it: a round starting before the next publish must
                # average them as they are, not the stale snapshot (that would count it twice).
                self._snapshot = self._snapshot + pending
        return pending

    def round(self, stop: bool) -> bool:
        """One collective round over all processes; returns whether any process asked to stop."""
        with self._lock:
            snapshot, pending = self._snapshot, self._pending
        if pending is not None:
            # Not yet pulled into the params: average what the params will be once it is.
            snapshot = snapshot + pending
        start = time.perf_counter()
        row = jax.device_put(snapshot[None], self._my_device)
        flag = jax.device_put(jnp.full((1,), int(stop), jnp.int32), self._my_device)
        delta, any_stop = self._program(
            jax.make_array_from_single_device_arrays(
                (self._nproc, snapshot.size), self._row_sharding, [row]
            ),
            jax.make_array_from_single_device_arrays((self._nproc,), self._row_sharding, [flag]),
        )
        delta = delta.addressable_shards[0].data[0]
        any_stop = bool(np.asarray(any_stop.addressable_shards[0].data))
        with self._lock:
            self._pending = delta if self._pending is None else self._pending + delta
            self._rounds += 1
            self._last_ms = (time.perf_counter() - start) * 1e3
        return any_stop

    def _loop(self) -> None:
        try:
            # The first round at once: averaging starts with local training, not an interval
            # after it (a short run would otherwise end before its first round).
            while not self.round(self._stop_requested.is_set()):
                # A local abort only shortens the wait: leaving must be agreed in a round.
                self._stop_requested.wait(self.sync_interval_ms / 1e3)
        except BaseException as e:  # noqa: BLE001 - surfaced by the next step() or abort()
            self._error = e

    def start(self) -> None:
        _RUNNING.add(self)
        self._stop_requested.clear()
        self._thread = threading.Thread(target=self._loop, name="async_model_average", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None) -> None:
        thread = self._thread
        if thread is None:
            return
        self._stop_requested.set()
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(
                f"async_model_average: the averaging thread did not stop within {timeout} s; "
                "every process must call abort() (a process that died or never calls it "
                "leaves the others waiting in the averaging collective)"
            )
        self._thread = None
        _RUNNING.discard(self)
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                f"async_model_average: the averaging thread failed: {error!r}"
            ) from error

    def lower(self, size: int):
        """Lowers one round's program for a model of ``size`` float32 values."""
        row = jax.ShapeDtypeStruct((self._nproc, size), jnp.float32, sharding=self._row_sharding)
        flag = jax.ShapeDtypeStruct((self._nproc,), jnp.int32, sharding=self._row_sharding)
        return self._program.lower(row, flag)

    def stats(self) -> AsyncModelAverageState:
        with self._lock:
            return AsyncModelAverageState(self._rounds, self._last_ms, self._thread is not None)


class AsyncModelAverage(TrainStep):
    """Local training plus asynchronous model averaging between processes (Bagua's algorithm).

    Build it with ``async_model_average(...)``; it is a ``TrainStep``. In every process::

        state = step.init(params)
        for batch in data:                    # this process's own batch
            state, metrics = step(state, batch)
        step.close()                          # collective: every process calls it
        params = step.params(state)           # one synchronous, exact average

    The first ``warmup_steps`` steps are synchronous full-precision data-parallel steps over
    every device; after them, local steps (gradients averaged only over this process's
    devices) while the background thread averages the model, from the end of the first local
    step on. Only that thread may issue collectives across processes meanwhile: a program of
    your own that does (an evaluation over the whole mesh) must wait for ``close()``.

    ``metrics["loss"]`` is the mean over all devices during warm-up and over this process's
    devices afterwards. ``lower(state, batch)`` lowers the program the next step runs (laid
    out over this process's devices after the warm-up); ``lower_averaging(state)`` one
    background round; ``communication_stats`` gives ``{"step": ..., "averaging": ...}``.
    """

    phases = ("step", "averaging")

    def __init__(self, loss_fn, optimizer, mesh, *, sync_interval_ms, warmup_steps, has_aux,
                 axes, flatten, exit_timeout=60.0):  # fmt: skip
        super().__init__("async", mesh, loss_fn, axes=axes, has_aux=has_aux, flatten=flatten)
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps
        # This process's row of the mesh, as a 1 x L mesh with the same axis names.
        row = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
        auto = (jax.sharding.AxisType.Auto,) * 2
        self.local_mesh = Mesh(np.array(row, dtype=object).reshape(1, -1), axes, axis_types=auto)
        tx = optax.chain(gradient_allreduce(node_axis=axes[0], local_axis=axes[1]), optimizer)
        # A state another step made is refused by these two, in this algorithm's name.
        self._global, self._local = (
            DataParallelStep(
                "async",
                self.loss_fn,
                {"step": tx},
                lambda _: "step",
                m,
                has_aux=has_aux,
                donate=False,
                axes=axes,
                flatten=False,
            )  # fmt: skip
            for m in (mesh, self.local_mesh)
        )
        self._averager = _Averager(mesh, axes[0], sync_interval_ms, exit_timeout)

    def _to_local(self, tree):
        sharding = NamedSharding(self.local_mesh, P())

        def move(x):
            if isinstance(x, jax.Array) and x.sharding == sharding:
                return x
            if isinstance(x, jax.ShapeDtypeStruct):  # lowering a state_shapes state
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
            value = x.addressable_shards[0].data if isinstance(x, jax.Array) else x
            return jax.device_put(np.asarray(value), sharding)

        return jax.tree.map(move, tree)

    def pull(self, params):
        """Adds the finished averaging rounds' ``mean(s) - s`` to ``params``."""
        pending = self._averager.take()
        if pending is None:
            return params
        delta = self._to_local(unflatten_like(pending, params))
        return jax.tree.map(lambda x, d: x + d, params, delta)

    # The programs and phases: the warm-up runs the global step's program, every later step
    # the local step's; the background averaging runs beside them, on a mesh of its own. ------

    def _inner(self, key) -> TrainStep:
        return self._global if key == "global" else self._local

    def _phase(self, steps_taken: int) -> tuple[str, Any]:
        return "step", "global" if steps_taken < self.warmup_steps else "local"

    @property
    def _state_step(self) -> TrainStep:
        """The first step's inner step (the warm-up's, or the local one's), whose state this
        step starts from."""
        return self._inner(self._phase(0)[1])

    def _local_state(self, state: StepState) -> StepState:
        """``state`` on this process's devices after the warm-up (unchanged before)."""
        if int(state.step) < self.warmup_steps:
            return state
        params, opt_state = self._to_local((state.params, state.opt_state))
        return StepState(state.step, params, opt_state, {})

    def program(self, state: StepState) -> Program:
        """The inner step's program for ``state``'s phase, on this process's devices after the
        warm-up, publishing each local step's params to the averaging."""
        key = self._phase(int(state.step))[1]
        if key in self._programs:
            return self._programs[key]
        inner = self._inner(key).program(self._local_state(state))

        def outputs(state: StepState, out):
            new, metrics = inner.outputs(state, out)
            taken = int(state.step)
            if taken < self.warmup_steps:
                return new, metrics
            self._averager.publish(new.params)
            if taken == self.warmup_steps and self.sync_interval_ms > 0:
                # Only after the local step has run once: a program's first run sets up its
                # collectives' communicators, which through Gloo must not overlap a round
                # (measured: a round started at init received the local step's bytes).
                jax.block_until_ready(new)
                self._averager.start()
            return new, metrics

        self._programs[key] = Program(
            inner.fn, lambda state, batch: inner.inputs(self._local_state(state), batch), outputs
        )
        return self._programs[key]

    def step(self, state: StepState, batch) -> tuple[StepState, dict[str, Any]]:
        """One local train step, after applying the averaging rounds finished since the last."""
        self._averager.raise_error()
        if isinstance(state, StepState) and int(state.step) >= self.warmup_steps:
            state = self._local_state(state)
            state = state._replace(params=self.pull(state.params))
        return super().step(state, batch)

    __call__ = step

    def _compiled_phases(self, state: StepState, batch) -> dict[str, Any]:
        """``{"step": ...}``: the next train step's program, compiled (the background round
        is no program of the step's: ``memory_stats`` has the step's alone)."""
        key = self._phase(int(state.step))[1]
        return {"step": self._compile(key, lambda: self.lower(state, batch), state, batch)}

    def communication_stats(self, state: StepState, batch) -> dict[str, Any]:
        """``{"step": ..., "averaging": ...}``: the next train step's bytes per device, and
        one background round's (see ``TrainStep.communication_stats``)."""
        mesh = self._inner(self._phase(int(state.step))[1]).mesh
        compiled = self._compiled_phases(state, batch)["step"]
        return {
            "step": stats.communication_stats(compiled, mesh=mesh),
            "averaging": stats.communication_stats(self.lower_averaging(state)),
        }

    def phase_counts(self, state: StepState) -> dict[str, int]:
        """Steps taken, and background averaging rounds done."""
        return {"step": int(state.step), "averaging": self._averager.stats().rounds}

    def lower_averaging(self, state):
        """Lowers one averaging round's program for ``state``'s params; it runs on one
        device per process, along a mesh axis named after the node axis."""
        size = jax.eval_shape(flatten_float32, state.params).size
        return self._averager.lower(size)

    def abort(self, timeout: float | None = 300.0) -> None:
        """Stops the background averaging; a collective call, made by every process.

        The thread finishes the round in flight (all processes leave after the same round),
        so no process is left waiting in a collective. Its last result is applied by the
        next ``step`` or ``pull``. Calling it when nothing runs does nothing.

        Raises:
          RuntimeError: if the thread does not stop within ``timeout`` seconds (a process
            died or never called ``abort``), or if it had failed.
        """
        self._averager.stop(timeout)

    def resume(self) -> None:
        """Restarts the background averaging after ``abort``; every process must call it."""
        if not self._averager.running and self.sync_interval_ms > 0:
            self._averager.start()

    def average_now(self, params):
        """One synchronous, exact average over processes, after ``abort``, on every process.

        Raises:
          RuntimeError: while the background thread runs (call ``abort()`` first).
        """
        if self._averager.running:
            raise RuntimeError(
                "async_model_average: average_now() while the averaging thread runs would "
                "interleave two collectives; call abort() (or close()) first"
            )
        params = self.pull(params)
        self._averager.publish(params)
        self._averager.round(False)
        return self.pull(params)

    def _params(self, state):
        """The exact average of the processes' models, replicated over the whole mesh. A
        collective: every process calls it, after ``close()``."""
        if not self._closed:
            raise RuntimeError(
                "async: params(state) averages the model over processes once, exactly, which "
                "cannot run beside the background averaging; call step.close() first (on "
                "every process)"
            )
        params = state.params
        if int(state.step) >= self.warmup_steps:
            params = self.average_now(self._to_local(params))
        return replicate(host_copy(params), self.mesh)

    @property
    def round_stats(self) -> AsyncModelAverageState:
        """Rounds done, the latest round's time and whether the thread runs."""
        return self._averager.stats()

    def close(self) -> None:
        """Stops the background averaging (a collective: every process calls it)."""
        if not self._closed:
            self.abort()
        super().close()


def async_model_average(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    peer_selection_mode: Literal["all"] = "all",
    sync_interval_ms: int = 500,
    warmup_steps: int = 0,
    has_aux: bool = False,
    node_axis: str = NODE_AXIS,
    local_axis: str = LOCAL_AXIS,
    flatten: bool = False,
) -> AsyncModelAverage:
    """Builds Bagua's asynchronous model averaging: local steps, averaged in the background.

    Every process trains with ``optimizer`` on its own batches (gradients averaged over its
    own devices in float32); a thread in every process averages the model over processes
    every ``sync_interval_ms`` milliseconds: ``x <- x + mean(s) - s``, with ``s`` the
    snapshot the round started from, so updates made meanwhile are kept. Processes never
    wait for each other's train steps, so a straggler slows only itself.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)``), on one device's slice.
      optimizer: a local optax optimizer (no ``bytegrad``/``gradient_allreduce``: added here).
      mesh: from ``make_mesh``; each process must be one node (one row).
      peer_selection_mode: ``"all"``, the only mode (as in Bagua).
      sync_interval_ms: milliseconds between averaging rounds; 0 turns averaging off.
      warmup_steps: synchronous gradient all-reduce steps before going asynchronous.
      has_aux, node_axis, local_axis, flatten: as for ``data_parallel_step`` (here each
        process is a node).

    Returns:
      An ``AsyncModelAverage``, a ``TrainStep`` with ``abort``, ``resume`` and
      ``round_stats`` besides.

    Raises:
      ValueError: for a bad ``peer_selection_mode``, ``sync_interval_ms`` or
        ``warmup_steps``, axis names the mesh lacks, or a node spanning processes (a TPU
        slice of several hosts, say).

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> from jax_bytegrad.experimental import async_model_average
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> step = async_model_average(lambda w, b: jnp.mean((b * w) ** 2), optax.sgd(0.1),
      ...                            mesh, sync_interval_ms=10)
      >>> state, metrics = step(step.init(jnp.ones(4)), jnp.ones((8, 4)))
      >>> step.close()
      >>> float(metrics["loss"])
      1.0

    References:
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
      Lian et al., "Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML 2018.
    """
    where = "async_model_average"
    checks.one_of(peer_selection_mode, ("all",), "peer_selection_mode", where)
    checks.integer(sync_interval_ms, "sync_interval_ms", where, minimum=0)
    checks.integer(warmup_steps, "warmup_steps", where, minimum=0)
    checks.mesh_axes(mesh, node_axis, local_axis, where)
    grid = np.asarray(mesh.devices)
    if mesh.axis_names.index(node_axis) != 0:
        grid = grid.T
    processes = _process_count(mesh)
    spanning = [sorted({d.process_index for d in row}) for row in grid]
    spanning = [row for row in spanning if len(row) > 1]
    if mesh.shape[node_axis] != processes or spanning:
        why = "Use jax_bytegrad.make_mesh() with its defaults"
        if spanning and getattr(grid.flat[0], "slice_index", None) is not None:
            # make_mesh() makes each TPU slice a node, whatever its hosts.
            why = (
                f"A node here spans processes {spanning[0]}: a TPU slice of several hosts. "
                "Run async on slices of one host each, or a synchronous algorithm (bytegrad, "
                "qadam, diloco) across slices"
            )
        raise ValueError(
            f"{where}: each process must be exactly one node of the mesh (each process "
            f"trains on its own, and a thread averages the processes' models); got "
            f"{mesh.shape[node_axis]} nodes for {processes} processes. {why}"
        )
    return AsyncModelAverage(
        loss_fn,
        optimizer,
        mesh,
        sync_interval_ms=int(sync_interval_ms),
        warmup_steps=int(warmup_steps),
        has_aux=has_aux,
        axes=(node_axis, local_axis),
        flatten=flatten,
    )
