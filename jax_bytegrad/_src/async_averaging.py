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

from jax_bytegrad._src import checks as _checks
from jax_bytegrad._src.buckets import flatten_float32, unflatten_like
from jax_bytegrad._src.parallel import data_parallel_step, shard_batch
from jax_bytegrad._src.transforms import gradient_allreduce

# Private helpers -------------------------------------------------------------------------


def _first_local_device(mesh: Mesh, process: int):
    return min((d for d in mesh.devices.flat if d.process_index == process), key=lambda d: d.id)


def _stop_at_exit(ref) -> None:
    averager = ref()
    if averager is not None:
        averager.stop(timeout=averager.exit_timeout)


def _local_mesh(mesh: Mesh, axes: tuple[str, str]) -> Mesh:
    """This process's row of ``mesh``, as a 1 x L mesh with the same axis names."""
    row = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    return Mesh(
        np.array(row, dtype=object).reshape(1, len(row)),
        axes,
        axis_types=(jax.sharding.AxisType.Auto,) * 2,
    )


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
        self._nproc = jax.process_count()
        # One device per process does the averaging: a float32 all-reduce of the whole model.
        # Its axis carries the node axis's name: each process is one node.
        firsts = [_first_local_device(mesh, p) for p in range(self._nproc)]
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
            while True:
                # A local abort only shortens the wait: leaving must be agreed in a round.
                self._stop_requested.wait(self.sync_interval_ms / 1e3)
                if self.round(self._stop_requested.is_set()):
                    return
        except BaseException as e:  # noqa: BLE001 - surfaced by the next step() or abort()
            self._error = e

    def start(self) -> None:
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
        self.raise_error()

    def raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(
                f"async_model_average: the averaging thread failed: {error!r}"
            ) from error

    def lower(self):
        n = self._snapshot.size if self._snapshot is not None else 1
        row = jax.ShapeDtypeStruct((self._nproc, n), jnp.float32, sharding=self._row_sharding)
        flag = jax.ShapeDtypeStruct((self._nproc,), jnp.int32, sharding=self._row_sharding)
        return self._program.lower(row, flag)

    def stats(self) -> AsyncModelAverageState:
        with self._lock:
            return AsyncModelAverageState(self._rounds, self._last_ms, self._thread is not None)


class AsyncModelAverage:
    """Local training plus asynchronous model averaging between processes (Bagua's algorithm).

    Build it with ``async_model_average(...)``. Then, in every process::

        params, opt_state = avg.init(params, opt_state)
        for batch in data:            # this process's own batch
            params, opt_state, loss = avg.step(params, opt_state, batch)
        avg.abort()                   # collective: every process calls it
        params = avg.average_now(params)   # optional: one synchronous, exact average

    ``step`` runs a synchronous full-precision data-parallel step over every device for the
    first ``warmup_steps`` steps, then local steps (gradients averaged only over this
    process's devices) while the background thread averages the model.
    """

    def __init__(
        self,
        loss_fn,
        optimizer,
        mesh,
        *,
        sync_interval_ms,
        warmup_steps,
        has_aux,
        node_axis,
        local_axis,
        exit_timeout=60.0,
    ):
        self.mesh = mesh
        self.sync_interval_ms = sync_interval_ms
        self.warmup_steps = warmup_steps
        self.step_id = 0
        self._axes = (node_axis, local_axis)
        self.local_mesh = _local_mesh(mesh, self._axes)
        self._sync_tx = optax.chain(
            gradient_allreduce(node_axis=node_axis, local_axis=local_axis), optimizer
        )
        kwargs = dict(has_aux=has_aux, donate=False, node_axis=node_axis, local_axis=local_axis)
        self._global_step = data_parallel_step(loss_fn, self._sync_tx, mesh, **kwargs)
        self._local_step = data_parallel_step(loss_fn, self._sync_tx, self.local_mesh, **kwargs)
        self._averager = _Averager(mesh, node_axis, sync_interval_ms, exit_timeout)
        atexit.register(_stop_at_exit, weakref.ref(self._averager))

    # Params placement ------------------------------------------------------------------

    def _to_local(self, tree):
        sharding = NamedSharding(self.local_mesh, P())

        def move(x):
            if isinstance(x, jax.Array) and x.sharding == sharding:
                return x
            value = x.addressable_shards[0].data if isinstance(x, jax.Array) else x
            return jax.device_put(np.asarray(value), sharding)

        return jax.tree.map(move, tree)

    def _local_batch(self, batch):
        sharding = NamedSharding(self.local_mesh, P(self._axes))
        return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), batch)

    def _start_averaging(self) -> None:
        if self.sync_interval_ms > 0 and not self._averager.running:
            self._averager.start()

    # Public API ------------------------------------------------------------------------

    def init(self, params, opt_state=None, *, start: bool = False):
        """Places ``params`` (the same on every process) and the optimizer state for ``step``.

        Args:
          params: the initial parameters, identical on every process.
          opt_state: optional optimizer state; by default ``optimizer.init(params)``.
          start: start the background averaging now (every process must), rather than at
            the first step after warm-up. Ignored during warm-up.

        Returns:
          ``(params, opt_state)``, replicated over the whole mesh during warm-up and over
          this process's devices afterwards.
        """
        if opt_state is None:
            opt_state = self._sync_tx.init(params)
        if self.step_id < self.warmup_steps:
            sharding = NamedSharding(self.mesh, P())
            place = lambda x: jax.make_array_from_process_local_data(sharding, np.asarray(x))
            return jax.tree.map(place, (params, opt_state))
        placed = self._to_local((params, opt_state))
        if start and self.sync_interval_ms > 0 and not self._averager.running:
            self._averager.publish(placed[0])
            self._averager.start()
        return placed

    def pull(self, params):
        """Adds the finished averaging rounds' ``mean(s) - s`` to ``params``.

        ``step`` calls it; call it yourself after ``abort()`` to take in the last round.
        """
        pending = self._averager.take()
        if pending is None:
            return params
        delta = self._to_local(unflatten_like(pending, params))
        return jax.tree.map(lambda x, d: x + d, params, delta)

    def step(self, params, opt_state, batch):
        """One train step on this process's ``batch`` (numpy or process-local arrays).

        Returns:
          ``(params, opt_state, loss[, aux])``: ``loss`` is the mean over all devices during
          warm-up and over this process's devices afterwards.
        """
        self._averager.raise_error()
        if self.step_id < self.warmup_steps:
            out = self._global_step(params, opt_state, shard_batch(batch, self.mesh))
            self.step_id += 1
            return out
        if self.step_id == self.warmup_steps:
            params, opt_state = self._to_local((params, opt_state))
        params = self.pull(params)
        out = self._local_step(params, opt_state, self._local_batch(batch))
        self._averager.publish(out[0])
        if self.step_id == self.warmup_steps:
            self._start_averaging()
        self.step_id += 1
        return out

    def lower(self, params, opt_state, batch):
        """Lowers the program the next ``step`` runs, for ``communication_stats``.

        The background averaging runs outside it: a float32 all-reduce of the whole model
        over processes per round.
        """
        if self.step_id < self.warmup_steps:
            return self._global_step.lower(params, opt_state, shard_batch(batch, self.mesh))
        params, opt_state = self._to_local((params, opt_state))
        return self._local_step.lower(params, opt_state, self._local_batch(batch))

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
        if not self._averager.running and self.step_id > self.warmup_steps:
            self._averager.start()

    def average_now(self, params):
        """One synchronous, exact average over processes: call it after ``abort`` on every process.

        Returns:
          ``params`` with pending rounds applied, then replaced by their mean over processes.

        Raises:
          RuntimeError: while the background thread runs (call ``abort()`` first).
        """
        if self._averager.running:
            raise RuntimeError(
                "async_model_average: average_now() while the averaging thread runs would "
                "interleave two collectives; call abort() first"
            )
        params = self.pull(params)
        self._averager.publish(params)
        self._averager.round(False)
        return self.pull(params)

    def lower_averaging(self):
        """Lowers one averaging round's program (for ``communication_stats``); runs nothing.

        It runs on one device per process, along a mesh axis named after ``node_axis``.
        """
        return self._averager.lower()

    @property
    def round_stats(self) -> AsyncModelAverageState:
        """Rounds done, the latest round's time and whether the thread runs."""
        return self._averager.stats()


def async_model_average(
    loss_fn: Callable[..., Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    peer_selection_mode: Literal["all"] = "all",
    sync_interval_ms: int = 500,
    warmup_steps: int = 0,
    has_aux: bool = False,
    node_axis: str = "node",
    local_axis: str = "local",
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
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      node_axis: the mesh axis between processes.
      local_axis: the mesh axis within a process.

    Returns:
      An ``AsyncModelAverage`` with ``init``, ``step``, ``pull``, ``abort``, ``resume`` and
      ``average_now``.

    Raises:
      ValueError: for a bad ``peer_selection_mode``, ``sync_interval_ms`` or
        ``warmup_steps``, axis names the mesh lacks, or a node spanning processes.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> from jax_bytegrad.experimental import async_model_average
      >>> mesh = jax_bytegrad.make_mesh(1, 1)
      >>> avg = async_model_average(lambda w, b: jnp.mean((b * w) ** 2), optax.sgd(0.1),
      ...                           mesh, sync_interval_ms=10)
      >>> w, s = avg.init(jnp.ones(4))
      >>> w, s, loss = avg.step(w, s, jnp.ones((8, 4)))
      >>> avg.abort()
      >>> float(loss)
      1.0

    References:
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
      Lian et al., "Asynchronous Decentralized Parallel Stochastic Gradient Descent", ICML 2018.
    """
    where = "async_model_average"
    if peer_selection_mode != "all":
        raise ValueError(f"{where}: peer_selection_mode must be 'all', got {peer_selection_mode!r}")
    _checks.non_negative_int(sync_interval_ms, "sync_interval_ms", where)
    _checks.non_negative_int(warmup_steps, "warmup_steps", where)
    _checks.mesh_axes(mesh, node_axis, local_axis, where)
    grid = np.asarray(mesh.devices)
    if mesh.axis_names.index(node_axis) != 0:
        grid = grid.T
    if mesh.shape[node_axis] != jax.process_count() or any(
        len({d.process_index for d in row}) != 1 for row in grid
    ):
        raise ValueError(
            f"{where}: each process must be exactly one node of the mesh; got "
            f"{mesh.shape[node_axis]} nodes for {jax.process_count()} processes. Use "
            "jax_bytegrad.make_mesh() with its defaults"
        )
    return AsyncModelAverage(
        loss_fn,
        optimizer,
        mesh,
        sync_interval_ms=int(sync_interval_ms),
        warmup_steps=int(warmup_steps),
        has_aux=has_aux,
        node_axis=node_axis,
        local_axis=local_axis,
    )
