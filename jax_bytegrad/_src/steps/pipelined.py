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

The stages are the wire's own (``wire.integer_bounds``, ``integer_encode``,
``integer_decode``; ``wire.sg_encode``, ``sg_average``, ``sg_decode``), with the same keys,
so the step computes the same values as ``data_parallel_step`` with
``optax.chain(bytegrad(...), optimizer)``, bit for bit (tests/test_pipelined.py), and holds
the same ``TrainState``: a checkpoint of one restores into the other.

Where it overlaps: with one device per process (one JAX process per host, the layout of CPU
clusters and of benchmarks/network.py). A process with several devices runs every program
over all of its devices, one program at a time in dispatch order (XLA's PJRT CPU client
gang-schedules them), so there the programs run one after another, correct but not
overlapped. The backward pass is not overlapped with the sync: the gradient is one program.
"""

import concurrent.futures
import dataclasses
import math
import queue
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import buckets as bucketing
from jax_bytegrad._src import checks, stats
from jax_bytegrad._src import wire as wires
from jax_bytegrad._src.config import Residuals, SyncConfig
from jax_bytegrad._src.quantization import resolve_implementation
from jax_bytegrad._src.sharding import replicate, state_specs
from jax_bytegrad._src.steps.base import (
    TrainState,
    TrainStep,
    compiler_options,
    count,
    global_batch,
    host_copy,
)
from jax_bytegrad._src.transforms import ByteGradState, bytegrad

# Private helpers -------------------------------------------------------------------------


class _Dispatcher:
    """One thread that runs the wire programs, in the order they are submitted.

    A daemon thread, so that a process whose main thread ends (or raises) never waits for
    it; ``close`` stops it.
    """

    def __init__(self, name: str):
        self._name = name
        self._queue = None
        self._thread = None
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        with self._lock:
            if self._thread is None:
                self._queue = queue.SimpleQueue()
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        future = concurrent.futures.Future()
        self._queue.put((future, fn, args))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        """Stops the thread once what was submitted has run."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join()


@dataclasses.dataclass(frozen=True)
class _Value:
    """A value between programs: its ``shard_map`` spec (tree) and global abstract value."""

    spec: Any
    aval: Any


def _aval(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class _Program:
    """One stage as a jitted ``shard_map`` over the mesh, built from its abstract inputs.

    Values between programs are per device: a value that varies over some mesh axes is
    stacked along its first dimension over those axes (``P((node, local))``, ``P(local)``,
    as error feedback's residuals are); one that is the same on every device is replicated
    (``P()``). The output specs are read from each output's varying axes when the stage is
    traced, so each value keeps the type the one-program step gives it.
    """

    def __init__(self, name: str, kind: str, fn, inputs, outputs, donate=()):
        self.name, self.kind, self.fn = name, kind, fn
        self.inputs, self.outputs, self.donate = tuple(inputs), tuple(outputs), tuple(donate)
        self.jitted = None

    def build(self, values: list[_Value], mesh: Mesh, axes: tuple[str, str]) -> list[_Value]:
        in_specs = tuple(v.spec for v in values)
        avals = tuple(v.aval for v in values)
        found = {}

        def probe(*args):
            out = self.fn(*args)
            found["vma"] = jax.tree.map(checks.varying_axes, out)
            found["local"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out)
            return jax.tree.map(lambda x: x[None], out)

        jax.eval_shape(
            jax.shard_map(probe, mesh=mesh, in_specs=in_specs, out_specs=P(axes)), *avals
        )

        def spec_of(vma, local):
            names = tuple(a for a in axes if a in vma)
            if not names:
                return P()
            if not local.shape:
                raise AssertionError(f"{self.name}: a per-device output must be an array")
            return P(names if len(names) > 1 else names[0])

        def global_aval(spec, local):
            shape = local.shape
            if spec != P():
                names = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
                shape = (shape[0] * math.prod(mesh.shape[a] for a in names), *shape[1:])
            return jax.ShapeDtypeStruct(shape, local.dtype, sharding=NamedSharding(mesh, spec))

        is_leaf = lambda x: isinstance(x, frozenset)  # noqa: E731
        out_specs = jax.tree.map(spec_of, found["vma"], found["local"], is_leaf=is_leaf)
        self.jitted = jax.jit(
            jax.shard_map(self.fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs),
            donate_argnums=self.donate,
            compiler_options=compiler_options(mesh),
        )
        out_avals = jax.tree.map(global_aval, out_specs, found["local"])
        return [_Value(s, a) for s, a in zip(out_specs, out_avals, strict=True)]


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """A piece of a bucket that crosses the wire in one exchange program.

    Attributes:
      bucket: the bucket's index.
      index: the piece's index in the bucket.
      start, stop: its range of blocks (integer wire: of the group's vector; scatter-gather:
        of each peer's row).
      pieces: scatter-gather: the message pieces it holds, as (index in the bucket, block
        slice) pairs.
    """

    bucket: int
    index: int
    start: int
    stop: int
    pieces: tuple = ()


def _split(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` consecutive ranges of about equal size covering ``range(count)``."""
    return [(count * i // parts, count * (i + 1) // parts) for i in range(parts)]


def _merge_stats(all_stats: list[stats.CommunicationStats]) -> stats.CommunicationStats:
    """The traffic of several programs that run once each per step, as one."""
    totals: dict[tuple, list] = {}
    for one in all_stats:
        for row in one.rows:
            entry = totals.setdefault((row.kind, row.axes, row.dtype), [0, 0, 0.0])
            entry[0] += row.count
            entry[1] += row.payload_bytes
            entry[2] += row.bytes_sent
    rows = tuple(
        stats.CollectiveTraffic(*key, *values)
        for key, values in totals.items()  # in the order the programs run
    )
    first = all_stats[0]
    return stats.CommunicationStats(rows, first.axis_names, first.axis_sizes)


class _Schedule:
    """The programs of one step, in the order the caller's thread walks them, built from
    the step's abstract inputs; ``values`` holds every value's spec and abstract value."""

    def __init__(self, tasks: list[_Program], inputs: dict[str, _Value], mesh, axes):
        self.tasks = tasks
        self.values = dict(inputs)
        for task in tasks:
            outs = task.build([self.values[name] for name in task.inputs], mesh, axes)
            self.values.update(zip(task.outputs, outs, strict=True))


# The step -----------------------------------------------------------------------------------


class PipelinedStep(TrainStep):
    """The ``TrainStep`` of ``pipelined_step``: several programs per step, two threads.

    ``lower(state, batch)`` gives ``{program name: jax.stages.Lowered}`` in the order the
    programs are dispatched (the one-program steps give one ``Lowered``);
    ``communication_stats`` sums their collectives as ``{"step": ...}``.
    """

    def __init__(self, loss_fn, optimizer, mesh, *, sync, average, seed, has_aux, donate,
                 flatten):  # fmt: skip
        super().__init__(
            "pipelined_step", mesh, loss_fn, axes=sync.axes, has_aux=has_aux, flatten=flatten,
            donate=donate,
        )  # fmt: skip
        self.sync = sync
        self._optimizer = optimizer
        self._average = average
        self._seed = seed
        # The state is the one-program step's: bytegrad's state, then the optimizer's.
        self._chain = optax.chain(
            bytegrad(mesh=mesh, average=average, seed=seed, **_sync_kwargs(sync)), optimizer
        )
        self._specs = None
        self._schedule = None
        self._where = (mesh, sync.axes)
        self._wire = _Dispatcher(f"{self.algorithm}-wire")

    # State. --------------------------------------------------------------------------------

    def _state_specs(self, opt_state):
        if self._specs is None:
            self._specs = state_specs(opt_state, node_axis=self._axes[0], local_axis=self._axes[1])
        return self._specs

    def _init(self, params) -> TrainState:
        params = replicate(host_copy(params), self.mesh)
        specs = self._state_specs(jax.eval_shape(self._chain.init, params))
        shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs)
        opt_state = jax.jit(self._chain.init, out_shardings=shardings)(params)
        return TrainState(count(0), params, opt_state, {})

    # The programs. -----------------------------------------------------------------------------

    def _layout(self, params):
        leaves = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in jax.tree.leaves(params)]
        n, local = (self.mesh.shape[a] for a in self._axes)
        granularity = n * local * self.sync.block_size
        return bucketing.make_layout(
            leaves, bucket_bytes=self.sync.bucket_bytes, granularity=granularity
        )

    def _plan(self, state: TrainState, batch) -> _Schedule:
        """The step's programs, built (traced, not compiled) from the abstract inputs."""
        if self._schedule is not None:
            return self._schedule
        tasks = _Stages(self, self._layout(state.params)).tasks()
        self._schedule = _Schedule(tasks, self._abstract_inputs(state, batch), *self._where)
        return self._schedule

    def _abstract_inputs(self, state: TrainState, batch) -> dict[str, _Value]:
        specs = self._state_specs(state.opt_state)
        sync_state, inner = state.opt_state
        sync_specs, inner_specs = specs
        per_device = P(self._axes)

        def value(tree, spec):
            return _Value(spec, jax.tree.map(_aval, tree))

        residuals = tuple(sync_state.residuals)
        return {
            "params": value(state.params, P()),
            "key": value(sync_state.key, P()),
            "inner": value(inner, inner_specs),
            "batch": value(batch, per_device),
            **{f"send{b}": value(pair[0], per_device) for b, pair in enumerate(residuals)},
            **{f"mean{b}": value(pair[1], per_device) for b, pair in enumerate(residuals)},
        }

    def _concrete_inputs(self, state: TrainState, batch) -> dict[str, Any]:
        sync_state, inner = state.opt_state
        residuals = tuple(sync_state.residuals)
        return {
            "params": state.params,
            "key": sync_state.key,
            "inner": inner,
            "batch": batch,
            **{f"send{b}": pair[0] for b, pair in enumerate(residuals)},
            **{f"mean{b}": pair[1] for b, pair in enumerate(residuals)},
        }

    # The protocol. -----------------------------------------------------------------------------

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict[str, Any]]:
        """One train step: ``(state, batch) -> (state, metrics)``.

        Returns once every exchange of the step has finished, so that no collective of this
        step is in flight when the caller's code runs; the last programs (the optimizer
        update) may still be computing.
        """
        if self._closed:
            raise RuntimeError(f"{self.algorithm}: this train step was closed; build a new one")
        batch = global_batch(batch, self.mesh, self._axes)
        self._state_specs(state.opt_state)
        schedule = self._plan(state, batch)
        values = self._concrete_inputs(state, batch)
        checks.not_deleted((state.params, state.opt_state), self.algorithm)
        self._in_flight.wait()
        pending: list[concurrent.futures.Future] = []
        try:
            values = self._run(schedule, values, pending)
        except BaseException:
            # Nothing more goes on the wire; what already runs is left to finish.
            for future in pending:
                future.cancel()
            concurrent.futures.wait(pending)
            raise
        self._in_flight.track(values["new_params"])
        old = tuple(state.opt_state[0].residuals)
        # The integer wire keeps one residual per bucket; its empty second one stays as is.
        residuals = Residuals(
            (values[f"new_send{b}"], values.get(f"new_mean{b}", pair[1]))
            for b, pair in enumerate(old)
        )
        opt_state = (ByteGradState(key=values["new_key"], residuals=residuals), values["new_inner"])
        metrics = {"loss": values["loss"]}
        if self.has_aux:
            metrics["aux"] = values["aux"]
        new = TrainState(count(int(state.step) + 1), values["new_params"], opt_state, {})
        return new, metrics

    __call__ = step

    def _run(self, schedule: _Schedule, values: dict, pending: list) -> dict:
        def resolve(name):
            value = values[name]
            if isinstance(value, _Pending):
                value = value.result()
                values[name] = value
            return value

        last_wire = None
        for task in schedule.tasks:
            if task.kind == "compute":
                out = task.jitted(*[resolve(name) for name in task.inputs])
                values.update(zip(task.outputs, out, strict=True))
            else:
                args = [values[name] for name in task.inputs]
                future = self._wire.submit(_call_resolved, task.jitted, args)
                pending.append(future)
                last_wire = future
                for i, name in enumerate(task.outputs):
                    values[name] = _Pending(future, i)
        for name in list(values):
            resolve(name)
        if last_wire is not None:
            # No collective of this step is left in flight when the caller's code runs.
            jax.block_until_ready(last_wire.result())
        return values

    def lower(self, state: TrainState, batch) -> dict[str, jax.stages.Lowered]:
        """Lowers every program of the step (runs nothing).

        Returns:
          ``{program name: jax.stages.Lowered}``, in dispatch order: ``"grad"``, the wire
          and codec programs of each bucket piece, ``"update"``.
        """
        batch = global_batch(batch, self.mesh, self._axes)
        self._state_specs(state.opt_state)
        schedule = self._plan(state, batch)
        values = schedule.values
        return {
            task.name: task.jitted.lower(*[values[name].aval for name in task.inputs])
            for task in schedule.tasks
        }

    def communication_stats(self, state: TrainState, batch) -> dict[str, stats.CommunicationStats]:
        """Bytes each device sends per step, summed over the step's programs; compiles them
        (runs nothing). Returns ``{"step": CommunicationStats}``."""
        lowered = self.lower(state, batch)
        return {"step": _merge_stats([stats.communication_stats(x) for x in lowered.values()])}

    def close(self) -> None:
        """Stops the dispatch thread (after what it was given has run). Calling it again does
        nothing."""
        self._closed = True
        self._wire.close()


class _Pending:
    """Output ``index`` of a wire program that the dispatch thread may not have run yet."""

    def __init__(self, future: concurrent.futures.Future, index: int):
        self.future, self.index = future, index

    def result(self):
        return self.future.result()[self.index]


def _call_resolved(jitted, args):
    return jitted(*[a.result() if isinstance(a, _Pending) else a for a in args])


def _sync_kwargs(sync: SyncConfig) -> dict[str, Any]:
    return {f.name: getattr(sync, f.name) for f in dataclasses.fields(sync)}


# The stages of one step ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Group:
    """Who compresses with whom, as the one-program sync has it (``wire.sum_flat``).

    Attributes:
      axis: the axes the codes are exchanged or summed over.
      gather: the scatter-gather wire's all_gather axes (the same devices).
      size: devices in the group.
      scatter: whether a float32 reduce-scatter within the node comes first.
      plain: one device in the group: nothing is compressed.
    """

    axis: Any
    gather: Any
    size: int
    scatter: bool

    @property
    def plain(self) -> bool:
        return self.size == 1


def _group(sync: SyncConfig, n: int, local: int) -> _Group:
    axes = sync.axes
    if not sync.hierarchical:
        return _Group(axes, axes, n * local, False)
    # With one device per node, the integer sum over both axes types its result replicated
    # over both; the scatter-gather wire gathers over both for the same reason.
    summed = sync.node_axis if local > 1 or sync.wire != "allreduce" else axes
    return _Group(summed, sync.node_axis if local > 1 else axes, n, local > 1)


def _chunks(sync: SyncConfig, group: _Group, local: int, padded: int, b: int) -> list[_Chunk]:
    """The pieces of bucket ``b`` (``padded`` values per device): at most ``bucket_bytes``
    of float32 each, of whole blocks (integer wire) or whole messages (scatter-gather)."""
    block = sync.block_size
    size = padded // local if group.scatter else padded
    wanted = 1 if sync.bucket_bytes is None else max(1, -(-padded * 4 // sync.bucket_bytes))
    if sync.wire == "allreduce" or group.plain:
        blocks = size // block
        parts = 1 if group.plain else min(wanted, blocks)
        return [_Chunk(b, i, s, e) for i, (s, e) in enumerate(_split(blocks, parts))]
    per_peer = size // (group.size * block)
    pieces = wires.message_slices(per_peer, block * sync.bits // 8, sync.message_bytes)
    chunks = []
    for i, (s, e) in enumerate(_split(len(pieces), min(wanted, len(pieces)))):
        held = tuple((j, pieces[j]) for j in range(s, e))
        chunks.append(_Chunk(b, i, held[0][1].start, held[-1][1].stop, held))
    return chunks


class _Stages:
    """The programs of one step of ``step`` for ``layout``, as the caller's thread walks
    them. Value names: ``bucket{b}`` / ``shard{b}`` the vector bucket b's group compresses,
    ``send{b}`` / ``mean{b}`` its residuals, ``{stage}{b}.{i}`` the values of piece i."""

    def __init__(self, step: "PipelinedStep", layout):
        sync = self.sync = step.sync
        self.axes = sync.axes
        self.layout = layout
        self.n, self.local = (step.mesh.shape[a] for a in self.axes)
        self.group = _group(sync, self.n, self.local)
        self.weight = 1.0 / (self.n * self.local) if step._average else 1.0
        self.codec = dict(
            stochastic=sync.stochastic,
            bits=sync.bits,
            implementation=resolve_implementation(sync.implementation),
        )
        self.integer = sync.wire == "allreduce"
        self.width = None
        if self.integer and not self.group.plain:
            self.width = wires.allreduce_width(sync.bits, self.group.size)
        self.buckets = range(len(layout.buckets))
        self.chunks = [
            _chunks(sync, self.group, self.local, layout.padded_sizes[b], b) for b in self.buckets
        ]
        self.has_aux = step.has_aux
        self.grad_fn = jax.value_and_grad(step.loss_fn, has_aux=step.has_aux)
        self.optimizer = step._optimizer
        self.donate = step._donate
        # The integer wire's bounds are of x + residual: known in the gradient's program
        # unless a float32 reduce-scatter within the node comes first.
        self.bounds_in_grad = self.integer and not self.group.plain and not self.group.scatter

    def tasks(self) -> list[_Program]:
        tasks = [self._grad()]
        if self.group.scatter:
            tasks += [self._scatter(b) for b in self.buckets]
        if self.group.plain:
            plain = [self._plain(b) for b in self.buckets]
            return [*tasks, self._metrics(), *plain, self._update()]
        if self.integer and self.group.scatter:
            tasks += [self._bounds(b) for b in self.buckets]
        tasks.append(self._metrics())
        stages = [
            self._integer(c) if self.integer else self._scatter_gather(c)
            for pieces in self.chunks
            for c in pieces
        ]
        tasks += _pipeline(stages)
        tasks += [self._join(b) for b in self.buckets]
        if self.sync.error_feedback:
            tasks += [p for b in self.buckets for p in self._residuals(b)]
        return [*tasks, self._update()]

    def source(self, b: int) -> str:
        return f"shard{b}" if self.group.scatter else f"bucket{b}"

    # Before the pieces. ----------------------------------------------------------------------

    def _grad(self) -> _Program:
        """Forward, backward, the buckets; the key of the step; the integer wire's bounds."""
        axes, layout, feedback = self.axes, self.layout, self.sync.error_feedback
        stochastic, block = self.sync.stochastic, self.sync.block_size
        num = len(self.buckets)

        def grad(params, key, batch, *sends):
            # Varying params: as in data_parallel_step, no hidden float32 all-reduce.
            out, grads = self.grad_fn(jax.lax.pcast(params, axes, to="varying"), batch)
            loss, aux = out if self.has_aux else (out, None)
            new_key, step_key = jax.random.split(key)
            buckets = bucketing.to_buckets(jax.tree.leaves(grads), layout)
            outs = [loss[None], new_key, *buckets]
            if self.has_aux:
                outs.append(jax.tree.map(lambda a: a[None], aux))
            if stochastic:
                # As sync_mean: each device's key, then one per bucket.
                device = jax.random.fold_in(step_key, jax.lax.axis_index(axes))
                keys = [jax.random.key_data(jax.random.fold_in(device, b)) for b in range(num)]
                outs.append(jnp.stack(keys))
            if self.bounds_in_grad:
                if feedback:
                    buckets = [x + r for x, r in zip(buckets, sends, strict=True)]
                outs += [wires.integer_bounds(x, block) for x in buckets]
            return tuple(outs)

        inputs = ["params", "key", "batch"]
        if self.bounds_in_grad and feedback:
            inputs += [f"send{b}" for b in self.buckets]
        outputs = ["loss_d", "new_key", *[f"bucket{b}" for b in self.buckets]]
        outputs += ["aux_d"] if self.has_aux else []
        outputs += ["keys"] if stochastic else []
        outputs += [f"bounds{b}" for b in self.buckets] if self.bounds_in_grad else []
        return _Program("grad", "compute", grad, inputs, outputs)

    def _scatter(self, b: int) -> _Program:
        local_axis = self.sync.local_axis

        def scatter(x):
            return (jax.lax.psum_scatter(x, local_axis, scatter_dimension=0, tiled=True),)

        return _Program(f"scatter{b}", "wire", scatter, [f"bucket{b}"], [f"shard{b}"])

    def _bounds(self, b: int) -> _Program:
        block, feedback = self.sync.block_size, self.sync.error_feedback

        def bounds(x, *send):
            return (wires.integer_bounds(x + send[0] if feedback else x, block),)

        inputs = [f"shard{b}"] + ([f"send{b}"] if feedback else [])
        return _Program(f"bounds{b}", "compute", bounds, inputs, [f"bounds{b}"])

    def _metrics(self) -> _Program:
        """The mean loss (and aux) over the devices; the integer wire's agreed bounds."""
        axes, group = self.axes, self.group.axis
        agree = self.integer and not self.group.plain

        def metrics(loss, *rest):
            rest = list(rest)
            outs = [jax.lax.pmean(loss[0], axes)]
            if self.has_aux:
                outs.append(jax.tree.map(lambda a: jax.lax.pmean(a[0], axes), rest.pop(0)))
            if agree:
                # One pmax for every bucket: the maximum is exact, so this is each bucket's.
                cuts = np.cumsum([x.shape[0] for x in rest])[:-1].tolist()
                outs += jnp.split(jax.lax.pmax(jnp.concatenate(rest), group), cuts)
            return tuple(outs)

        inputs = ["loss_d"] + (["aux_d"] if self.has_aux else [])
        outputs = ["loss"] + (["aux"] if self.has_aux else [])
        if agree:
            inputs += [f"bounds{b}" for b in self.buckets]
            outputs += [f"agreed{b}" for b in self.buckets]
        return _Program("metrics", "wire", metrics, inputs, outputs)

    def _plain(self, b: int) -> _Program:
        """One device per group, nothing compressed: the bucket's float32 sum, as is."""
        sync, local, weight = self.sync, self.local, self.weight
        feedback = sync.error_feedback

        def total(x, *residual):
            out, residual = wires.sum_flat(
                x, sync, n=self.n, local=local, weight=weight, key=None, codec=self.codec,
                residual=tuple(residual) if feedback else None,
            )  # fmt: skip
            return (out, *residual) if feedback else (out,)

        inputs = [f"bucket{b}"] + ([f"send{b}", f"mean{b}"] if feedback else [])
        outputs = [f"avg{b}"] + ([f"new_send{b}", f"new_mean{b}"] if feedback else [])
        return _Program(f"sum{b}", "wire", total, inputs, outputs)

    # The pieces. -----------------------------------------------------------------------------

    def _key(self, keys, b: int):
        return None if keys is None else jax.random.wrap_key_data(keys[b])

    def _integer(self, c: _Chunk) -> list[_Program]:
        """encode -> psum -> decode of one piece (``wire.integer_sum``'s stages)."""
        sync, group, width = self.sync, self.group, self.width
        block, feedback, stochastic = sync.block_size, sync.error_feedback, sync.stochastic
        tag, s, e = f"{c.bucket}.{c.index}", c.start * sync.block_size, c.stop * sync.block_size

        def encode(x, agreed, *rest):
            rest = list(rest)
            x = x[s:e]
            if feedback:
                x = x + rest.pop(0)[s:e]
            key = self._key(rest.pop(0) if stochastic else None, c.bucket)
            codes, kept = wires.integer_encode(
                x, agreed[c.start : c.stop], block_size=block, width=width,
                stochastic=stochastic, seed=None if key is None else wires.dither_seed(key),
                first_block=c.start, feedback=feedback,
            )  # fmt: skip
            return (codes, kept) if feedback else (codes,)

        def psum(codes):
            return (jax.lax.psum(codes, group.axis),)

        def decode(total, agreed):
            decoded = wires.integer_decode(
                total, agreed[c.start : c.stop], width=width, group_size=group.size,
                weight=self.weight, stochastic=stochastic,
            )  # fmt: skip
            return (decoded,)

        inputs = [self.source(c.bucket), f"agreed{c.bucket}"]
        inputs += ([f"send{c.bucket}"] if feedback else []) + (["keys"] if stochastic else [])
        outputs = [f"codes{tag}"] + ([f"kept{tag}"] if feedback else [])
        return [
            _Program(f"encode{tag}", "compute", encode, inputs, outputs),
            _Program(f"psum{tag}", "wire", psum, [f"codes{tag}"], [f"total{tag}"]),
            _Program(
                f"decode{tag}", "compute", decode, [f"total{tag}", f"agreed{c.bucket}"],
                [f"part{tag}"],
            ),
        ]  # fmt: skip

    def _scatter_gather(self, c: _Chunk) -> list[_Program]:
        """quantize -> all_to_all -> average -> all_gather -> decode of one piece (the
        stages of ``wire._scatter_gather_piece``, for each message piece it holds)."""
        sync, group, codec = self.sync, self.group, self.codec
        block, feedback, stochastic = sync.block_size, sync.error_feedback, sync.stochastic
        exchange = wires._all_to_all(sync.wire, sync.message_bytes)
        tag = f"{c.bucket}.{c.index}"

        def piece_key(keys, j):
            key = self._key(keys, c.bucket)
            return None if key is None else jax.random.fold_in(key, j)

        def rows(x):  # (peers, blocks per peer, block), as scatter_gather_sum_flat has it
            return x.reshape(group.size, -1, block)

        def quantize(x, *rest):
            rest = list(rest)
            send = rows(rest.pop(0)) if feedback else None
            keys = rest.pop(0) if stochastic else None
            messages, kept = [], []
            for j, blocks in c.pieces:
                message, new = wires.sg_encode(
                    rows(x)[:, blocks], None if send is None else send[:, blocks],
                    key=piece_key(keys, j), codec=codec,
                )  # fmt: skip
                messages.append(message)
                kept.append(new)
            if feedback:
                return tuple(messages), jnp.concatenate(kept, axis=1).reshape(-1)
            return (tuple(messages),)

        def all_to_all(messages):
            return (tuple(exchange(m, group.axis) for m in messages),)

        def average(received, *rest):
            rest = list(rest)
            mean = rest.pop(0).reshape(-1, block) if feedback else None
            keys = rest.pop(0) if stochastic else None
            messages, kept = [], []
            for (j, blocks), got in zip(c.pieces, received, strict=True):
                message, new = wires.sg_average(
                    got, None if mean is None else mean[blocks], weight=self.weight,
                    key=piece_key(keys, j), codec=codec, block_size=block,
                )  # fmt: skip
                messages.append(message)
                kept.append(new)
            if feedback:
                return tuple(messages), jnp.concatenate(kept, axis=0).reshape(-1)
            return (tuple(messages),)

        def all_gather(messages):
            gather = jax.lax.all_gather
            return (tuple(gather(m, group.gather, axis=0, to="invarying") for m in messages),)

        def decode(gathered):
            parts = [wires.sg_decode(g, codec=codec, block_size=block) for g in gathered]
            return (jnp.concatenate(parts, axis=1),)

        keys = ["keys"] if stochastic else []
        q_in = [self.source(c.bucket)] + ([f"send{c.bucket}"] if feedback else []) + keys
        q_out = [f"message{tag}"] + ([f"kept{tag}"] if feedback else [])
        v_in = [f"received{tag}"] + ([f"mean{c.bucket}"] if feedback else []) + keys
        v_out = [f"average{tag}"] + ([f"kept_mean{tag}"] if feedback else [])
        return [
            _Program(f"quantize{tag}", "compute", quantize, q_in, q_out),
            _Program(f"all_to_all{tag}", "wire", all_to_all, [f"message{tag}"],
                     [f"received{tag}"]),
            _Program(f"average{tag}", "compute", average, v_in, v_out),
            _Program(f"all_gather{tag}", "wire", all_gather, [f"average{tag}"],
                     [f"gathered{tag}"]),
            _Program(f"decode{tag}", "compute", decode, [f"gathered{tag}"], [f"part{tag}"]),
        ]  # fmt: skip

    # After the pieces. -----------------------------------------------------------------------

    def _join(self, b: int) -> _Program:
        """Bucket b's mean, whole, replicated: its pieces joined (and gathered over the
        node's devices after a reduce-scatter)."""
        integer, local_axis = self.integer, self.sync.local_axis
        names = [f"part{c.bucket}.{c.index}" for c in self.chunks[b]]

        def join(parts):
            if integer:
                return parts[0] if len(parts) == 1 else jnp.concatenate(parts)
            whole = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=1)
            return whole.reshape(-1)

        if self.group.scatter:
            return _Program(
                f"gather{b}", "wire",
                lambda *parts: (wires.gather_invariant(join(parts), local_axis),),
                names, [f"avg{b}"],
            )  # fmt: skip
        return _Program(f"join{b}", "compute", lambda *parts: (join(parts),), names, [f"avg{b}"])

    def _residuals(self, b: int) -> list[_Program]:
        """Error feedback's new residuals of bucket b, in the state's layout."""
        tags = [f"{c.bucket}.{c.index}" for c in self.chunks[b]]
        size = self.group.size

        def send(*parts):
            if self.integer or len(parts) == 1:
                return (parts[0] if len(parts) == 1 else jnp.concatenate(parts),)
            # Each piece holds every peer's rows: join them peer by peer.
            rows = [p.reshape(size, -1) for p in parts]
            return (jnp.concatenate(rows, axis=1).reshape(-1),)

        def mean(*parts):
            return (parts[0] if len(parts) == 1 else jnp.concatenate(parts),)

        programs = [
            _Program(f"residual{b}", "compute", send, [f"kept{t}" for t in tags],
                     [f"new_send{b}"]),
        ]  # fmt: skip
        if not self.integer:  # the integer wire keeps one residual; its mean stays empty
            programs.append(
                _Program(f"residual_mean{b}", "compute", mean,
                         [f"kept_mean{t}" for t in tags], [f"new_mean{b}"])
            )  # fmt: skip
        return programs

    def _update(self) -> _Program:
        """The optimizer on the mean gradient, and the new parameters."""
        layout, optimizer = self.layout, self.optimizer

        def update(params, inner, *means):
            leaves, treedef = jax.tree.flatten(params)
            grads = jax.tree.unflatten(treedef, bucketing.from_buckets(means, leaves, layout))
            updates, inner = optimizer.update(grads, inner, params)
            return optax.apply_updates(params, updates), inner

        return _Program(
            "update", "compute", update, ["params", "inner", *[f"avg{b}" for b in self.buckets]],
            ["new_params", "new_inner"], donate=(0, 1) if self.donate else (),
        )  # fmt: skip


def _pipeline(stages: list[list[_Program]]) -> list[_Program]:
    """The pieces' stages as a software pipeline: stage k of piece c at tick c + k.

    In each tick the wire programs are submitted first, the oldest piece's first (the order
    of the exchanges); then the compute programs, the newest piece's first, so that the
    caller's thread dispatches the next encode before it waits for an exchange to decode.
    """
    depth = max(len(s) for s in stages)
    order = []
    for tick in range(len(stages) + depth - 1):
        now = [s[tick - c] for c, s in enumerate(stages) if 0 <= tick - c < len(s)]
        order += [p for p in now if p.kind == "wire"]
        order += [p for p in reversed(now) if p.kind == "compute"]
    return order


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
    mesh)``, bit for bit, with the same ``TrainState``, cut into programs at the sync's
    collectives (module docstring): the wire programs run on a dispatch thread of the
    step's own, one at a time and in the same order on every process, while the caller's
    thread runs the codec of the pieces before and after. Each bucket crosses the wire in
    pieces of at most ``sync.bucket_bytes`` of float32 (a leaf larger than that is cut too),
    so a smaller bucket overlaps more and pays more exchanges. ``step(state, batch)``
    returns once the step's last exchange has finished. Use it as a context manager, or
    call ``close()``, to stop the thread.

    It overlaps where each process has one device (one process per host); see the module
    docstring. ``Strategy("bytegrad", pipeline=True)`` builds it.

    Args:
      loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``),
        computed on one device's slice of the batch.
      optimizer: the optax optimizer applied to the mean gradient (``optax.adam(1e-3)``).
      mesh: from ``make_mesh``.
      sync: the compressed sync's settings (``SyncConfig``, both wires, error feedback and
        stochastic rounding included); None for the defaults.
      average: divide the sum by the device count (default), as ``bytegrad``'s.
      seed: seeds the PRNG key of stochastic rounding, as ``bytegrad``'s.
      has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
      donate: donate the params and optimizer-state buffers to the update program.
      flatten: keep the params, gradient and optimizer state as one float32 vector.

    Returns:
      A ``PipelinedStep`` (a ``TrainStep``): ``init``, ``step``, ``params``, ``lower`` (one
      ``Lowered`` per program, by name), ``communication_stats``, ``phase_counts``,
      ``close``.

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
    where = "pipelined_step"
    if not isinstance(optimizer, optax.GradientTransformation):
        raise ValueError(
            f"{where}: optimizer must be an optax.GradientTransformation such as "
            f"optax.adam(1e-3), got {type(optimizer).__name__}"
        )
    if sync is None:
        sync = SyncConfig(where=where)
    if not isinstance(sync, SyncConfig):
        raise ValueError(
            f"{where}: sync must be a jax_bytegrad.SyncConfig, got {type(sync).__name__}; "
            "pass sync=SyncConfig(wire=..., ...)"
        )
    checks.boolean(average, "average", where)
    checks.integer(seed, "seed", where, minimum=0)
    sync.mesh_shape(mesh, where)
    return PipelinedStep(
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
