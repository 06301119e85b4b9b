"""A scheduler of jitted programs on two threads: compute on the caller's, collectives on one more.

XLA:CPU runs the collectives of one program one after another, each blocking, but two programs
dispatched from different threads do run at once (JAX uses the calling thread as the execution
stream). So a step cut into programs at its collectives can put its exchanges on the wire while
its compute goes on: the programs that hold collectives (``"wire"``) run on one ``Dispatcher``
thread, in the order they are submitted, the same order on every process (Gloo tags every
operation alike); the others (``"compute"``) on the caller's thread. ``Program`` builds each
stage as a jitted ``shard_map`` from its abstract inputs, ``Schedule`` links the stages' values
and ``execute`` runs one step of them. The pipelined step
(``algorithms/bytegrad/pipelined.py``) is built on it. A step of several programs lowers to
``LoweredPrograms``, which compiles to ``CompiledPrograms``.
"""

import collections
import concurrent.futures
import dataclasses
import math
import queue
import threading
from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks

# The dispatch thread ------------------------------------------------------------------------


class Dispatcher:
    """One thread that runs the wire programs, in the order they are submitted.

    A daemon thread, so that a process whose main thread ends (or raises) never waits for
    it; ``close`` stops it. The same thread for every step: JAX runs the programs one thread
    dispatches one after another (its execution stream), so the wire programs never overlap
    each other.
    """

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        with self._lock:
            if self._thread is None:
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
        """Whether the thread runs (it starts with the first program submitted)."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def close(self) -> None:
        """Stops the thread once what was submitted has run."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is not None:
                self._queue.put(None)
        if thread is not None:
            thread.join()


class Pending:
    """Output ``index`` of a wire program that the dispatch thread may not have run yet."""

    def __init__(self, future: concurrent.futures.Future, index: int):
        self.future, self.index = future, index

    def result(self):
        return self.future.result()[self.index]


def call_resolved(jitted, args):
    return jitted(*[a.result() if isinstance(a, Pending) else a for a in args])


# Programs ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Value:
    """A value between programs: its ``shard_map`` spec (a tree) and global abstract value."""

    spec: Any
    aval: Any


def aval(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


class Program:
    """One stage as a jitted ``shard_map`` over the mesh, built from its abstract inputs.

    Values between programs are per device: a value that varies over some mesh axes is
    stacked along its first dimension over those axes (``P((node, local))``, ``P(local)``,
    as error feedback's residuals are); one that is the same on every device is replicated
    (``P()``). The output specs are read from each output's varying axes when the stage is
    traced, so each value keeps the type the one-program step gives it.

    Values go by name (any hashable; ``algorithms/bytegrad/stages.py`` gives typed ones):
    ``fn(values)`` takes a dict of the values named by ``chains``, ``reads`` and ``inputs``,
    and returns a dict of the chains' new values, under the chains' names, and of its
    outputs, under names of its own. Error feedback's residuals (``chains``) are threaded
    through the programs that read or write them, donated and updated in place; ``reads``
    are chains it only reads.
    ``Schedule`` names each version of a chain after the order the programs run in.

    Args:
      name: the program's name (``lower`` keys).
      kind: ``"compute"`` (dispatched by the caller's thread) or ``"wire"`` (it holds
        collectives: the dispatch thread runs it).
      fn: the per-device function, from values by name to values by name.
      inputs: the names of its other values.
      chains, reads: the chains it updates, and those it only reads.
      donate: names in ``inputs`` to donate.
    """

    def __init__(self, name, kind, fn, inputs=(), *, chains=(), reads=(), donate=()):
        self.name, self.kind, self.fn = name, kind, fn
        self.inputs, self.chains, self.reads = tuple(inputs), tuple(chains), tuple(reads)
        self.donate = tuple(donate)

    @property
    def arguments(self) -> tuple:
        """The names of the jitted program's arguments, in order."""
        return (*self.chains, *self.reads, *self.inputs)

    def build(self, values: list[Value], mesh: Mesh, axes: tuple[str, str], *,
              donate_argnums: tuple[int, ...]) -> tuple[Any, dict[Hashable, Value]]:  # fmt: skip
        """The jitted program for these inputs (``arguments``' values, in order), and its
        outputs' values by name, the chains' first, in the order the program returns them."""
        in_specs = tuple(v.spec for v in values)
        avals = tuple(v.aval for v in values)
        found = {}

        def call(*args):
            out = self.fn(dict(zip(self.arguments, args, strict=True)))
            own = [name for name in out if name not in self.chains]
            return tuple(out[name] for name in found.setdefault("names", (*self.chains, *own)))

        call.__name__ = self.fn.__name__  # the HLO module's name

        def probe(*args):
            out = call(*args)
            found["vma"] = jax.tree.map(checks.varying_axes, out)
            found["local"] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), out)
            return jax.tree.map(lambda x: x[None], out)

        mapped = dict(mesh=mesh, in_specs=in_specs)
        jax.eval_shape(jax.shard_map(probe, out_specs=P(axes), **mapped), *avals)

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
        jitted = jax.jit(
            jax.shard_map(call, out_specs=out_specs, **mapped), donate_argnums=donate_argnums
        )
        out_avals = jax.tree.map(global_aval, out_specs, found["local"])
        outputs = zip(out_specs, out_avals, strict=True)
        return jitted, {n: Value(s, a) for n, (s, a) in zip(found["names"], outputs, strict=True)}


class Version(NamedTuple):
    """Version ``n`` (1 or more) of a chain: its value after the n-th program that updates
    it. Version 0 is the chain's own name: the value the step was given."""

    chain: Hashable
    n: int


class Task(NamedTuple):
    """A program as a schedule runs it: ``jitted(*values named input_names)`` gives the
    values named ``output_names``."""

    name: str
    kind: str
    jitted: Any
    input_names: tuple
    output_names: tuple


class Schedule:
    """The programs of one step, in the order the caller's thread walks them, built from
    the step's abstract inputs (by name) as ``Task``s. ``values`` holds every value's spec
    and abstract value, ``last_use`` where each value is last read; ``latest(chain)`` names
    a chain's last version.

    Version 0 of a chain, a residual of the state, is donated only with ``donate_state``;
    later versions always.
    """

    def __init__(self, programs: list[Program], inputs: dict[Hashable, Value], mesh, axes, *,
                 donate_state: bool):  # fmt: skip
        self.values = dict(inputs)
        self.tasks: list[Task] = []
        self.last_use: dict[Hashable, int] = {}
        self._updates: collections.Counter = collections.Counter()  # of each chain so far
        for i, program in enumerate(programs):
            self.tasks.append(self._build(program, mesh, axes, donate_state))
            self.last_use.update((name, i) for name in self.tasks[-1].input_names)

    def latest(self, chain: Hashable) -> Hashable:
        """The name of ``chain``'s last version (its own name if no program updates it)."""
        n = self._updates[chain]
        return Version(chain, n) if n else chain

    def _build(self, program: Program, mesh, axes, donate_state: bool) -> Task:
        chained = [self.latest(c) for c in (*program.chains, *program.reads)]
        names = (*chained, *program.inputs)
        donate = [i for i, c in enumerate(program.chains) if self._updates[c] or donate_state]
        donate += [len(chained) + program.inputs.index(n) for n in program.donate]
        jitted, outputs = program.build(
            [self.values[n] for n in names], mesh, axes, donate_argnums=tuple(donate)
        )
        self._updates.update(program.chains)
        named = {self.latest(n) if n in program.chains else n: v for n, v in outputs.items()}
        self.values.update(named)
        return Task(program.name, program.kind, jitted, names, tuple(named))


def execute(schedule: Schedule, values: dict, wire: Dispatcher, keep) -> dict:
    """Runs one step of ``schedule`` on the input ``values``; returns the values in ``keep``.

    Compute programs are dispatched from this thread, wire programs handed to ``wire``
    in order. Each value is dropped after its last use, so its buffer can be reused. Returns
    once the last wire program has finished; on an error, cancels the wire programs not yet
    started and waits for the one running before raising.
    """
    pending: list[concurrent.futures.Future] = []

    def resolve(name):
        value = values[name]
        if isinstance(value, Pending):
            value = values[name] = value.result()
        return value

    try:
        for i, task in enumerate(schedule.tasks):
            if task.kind == "compute":
                out = task.jitted(*[resolve(name) for name in task.input_names])
                values.update(zip(task.output_names, out, strict=True))
            else:
                args = [values[name] for name in task.input_names]
                future = wire.submit(call_resolved, task.jitted, args)
                pending.append(future)
                outs = task.output_names
                values.update((name, Pending(future, j)) for j, name in enumerate(outs))
            for name in task.input_names:
                if schedule.last_use[name] == i and name not in keep:
                    del values[name]
        out = {name: resolve(name) for name in keep if name in values}
        if pending:
            # No collective of this step is left in flight when the caller's code runs.
            jax.block_until_ready(pending[-1].result())
    except BaseException:
        for future in pending:
            future.cancel()
        concurrent.futures.wait(pending)
        raise
    return out


# A step of several programs, lowered and compiled ---------------------------------------------


class CompiledPrograms:
    """The compiled programs of one step of several (``LoweredPrograms.compile()``).

    Attributes:
      programs: ``{program name: jax.stages.Compiled}``, in dispatch order.
    """

    def __init__(self, programs: dict[str, jax.stages.Compiled]):
        self.programs = programs

    def as_text(self) -> str:
        """Every program's optimized HLO, in dispatch order, each under a ``// name`` line."""
        return "\n".join(f"// {name}\n{p.as_text()}" for name, p in self.programs.items())


class LoweredPrograms:
    """``lower`` of a step that runs several programs per step (``pipelined_step``).

    It answers where a ``jax.stages.Lowered`` is used: ``.compile()`` (every program, for
    the programs' mesh, whose devices need not be here) and ``.as_text()``;
    ``jax_bytegrad.profiling.communication_stats`` takes each of ``.programs``.

    Attributes:
      programs: ``{program name: jax.stages.Lowered}``, in the order the step dispatches
        them (``pipelined_step``: ``"grad"``, each bucket piece's codec and wire programs,
        ``"update"``).
    """

    def __init__(self, programs: dict[str, jax.stages.Lowered]):
        self.programs = programs

    def compile(self) -> CompiledPrograms:
        """Compiles every program; runs nothing."""
        return CompiledPrograms({name: p.compile() for name, p in self.programs.items()})

    def as_text(self) -> str:
        """Every program's lowered module, in dispatch order, each under a ``// name`` line."""
        return "\n".join(f"// {name}\n{p.as_text()}" for name, p in self.programs.items())
