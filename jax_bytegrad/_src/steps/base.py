"""One protocol for every train step: ``init``, ``step``, ``params``, ``lower``,
``communication_stats``, ``phase_counts`` and ``close``.

Follows Bagua's algorithm interface (Gan et al., "Bagua: Scaling up Distributed Learning with
System Relaxations", VLDB 2022), where every algorithm plugs into the same training loop. Here
every builder (``data_parallel_step``, ``decentralized_step``,
``low_precision_decentralized_step``, ``experimental.async_model_average``) returns a
``TrainStep``; the state it carries is a ``StepState``.

A step whose communication changes from step to step (QAdam's warm-up and compressed phases,
decentralized SGD's gossip rounds) compiles one program per phase and picks it on the host from
the step count. No collective sits inside a ``lax.cond`` and each program fuses whole; the
multi-process test ``tests/test_multiprocess.py`` also shows that QAdam's one-program form,
with its collectives inside a ``lax.cond``, does not deadlock XLA:CPU under load.
"""

import collections
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import checks, guard
from jax_bytegrad._src.inspection import memory, stats
from jax_bytegrad._src.mesh import shard_batch
from jax_bytegrad._src.runtime.programs import CompiledPrograms, LoweredPrograms
from jax_bytegrad._src.steps.model_state import ModelState, step_key


class StepState(NamedTuple):
    """What a train step carries from one step to the next; a pytree.

    Orbax checkpoints it as it is (``StandardCheckpointer().save(path, state)``) and restores
    it onto ``step.init(params)`` as the target, for every algorithm but ``async`` (whose
    processes hold different models by design: checkpoint ``step.params(state)`` instead).

    Attributes:
      step: steps taken, a 0-d int64 numpy array (host side: the step picks the program of
        each phase from it without a device round trip).
      params: the parameters: replicated for ``gradient_allreduce``, ``bytegrad``, ``qadam``
        and ``async``; one copy per device, stacked on a leading axis, for the decentralized
        pair (``step.params(state)`` averages them).
      opt_state: the optimizer state, laid out like ``params`` (it holds ByteGrad's and
        QAdam's own state; error-feedback residuals are sharded per device).
      extra: the algorithm's state beyond those two, by name (the peers' weights of
        ``low_precision_decentralized``), and the model state and key of a step built with
        ``model_state=`` or ``rng_seed=`` (``"model_state"``, ``"rng"``); empty otherwise,
        so a state without them has the layout, and restores the checkpoints, it always had.
      model_state: (property) ``extra["model_state"]``: the model's state that is not
        trained (BatchNorm statistics, counters), replicated; None without one.
      rng: (property) ``extra["rng"]``: ``jax.random.key(rng_seed)``, replicated, from which
        each step's per-device keys derive with the step count (``TrainStep.device_key``);
        None without.
    """

    step: np.ndarray
    params: optax.Params
    opt_state: optax.OptState
    extra: dict[str, Any]

    @property
    def model_state(self) -> Any:
        return self.extra.get("model_state") if isinstance(self.extra, dict) else None

    @property
    def rng(self) -> Any:
        return self.extra.get("rng") if isinstance(self.extra, dict) else None


# How far communication_stats looks for a step of each phase (QAdam's warm-up can be long).
_PHASE_SEARCH = 1 << 24


def count(n: int) -> np.ndarray:
    """A step count as ``StepState`` holds it."""
    return np.asarray(n, np.int64)


def abstract(tree, sharding=None):
    """``tree``'s leaves (arrays or ``ShapeDtypeStruct``) as ``ShapeDtypeStruct``, placed by
    ``sharding`` (None keeps none)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def host_copy(tree):
    """A host copy of ``tree``: a donating step must not consume the caller's buffers
    (``device_put`` of a host array may alias it)."""
    return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))


@jax.jit
def device_mean(tree):
    """Each leaf's mean over its leading axis: the per-device losses (and aux) a step with a
    row per device (decentralized) or per node (DiLoCo) returns, as one number each."""
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), tree)


def process_mean(tree):
    """``device_mean`` of this process's rows alone, on its first device: where processes
    are nodes, a mean over every device would be a collective between them."""

    def one(x):
        shards = [s.data for s in x.addressable_shards]
        first = next(iter(shards[0].devices()))
        return jnp.mean(jnp.concatenate([jax.device_put(s, first) for s in shards]), axis=0)

    return jax.tree.map(one, tree)


class StepsInFlight:
    """Keeps at most one train step in flight on XLA:CPU with several devices.

    XLA:CPU runs every simulated device's share of a program on one shared thread pool.
    Dispatching steps without waiting queues many programs' collectives on it; on a host
    with fewer cores than devices a rendezvous can then miss a participant for 40 s, and
    XLA aborts the process ("Termination timeout for all reduce"); tests/test_parallel.py
    runs such a loop. The wait costs nothing there (the cores are busy anyway) and is
    skipped on other platforms, where queuing steps keeps the accelerator fed.
    """

    def __init__(self, mesh: Mesh):
        devices = list(mesh.devices.flat)
        self.enabled = len(devices) > 1 and devices[0].platform == "cpu"
        self._last = None

    def wait(self) -> None:
        """Blocks until the step dispatched last has finished."""
        last, self._last = self._last, None
        if last is not None and not last.is_deleted():
            last.block_until_ready()

    def track(self, out) -> None:
        """Remembers a step's output; every output of one program is ready together."""
        if self.enabled:
            leaves = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
            self._last = leaves[-1] if leaves else None


def _communication(compiled, mesh: Mesh | None) -> stats.CommunicationStats:
    """A step's bytes per device from its compiled program: summed over the programs of a
    ``CompiledPrograms``, each read on the mesh it was laid out for."""
    if isinstance(compiled, CompiledPrograms):
        return stats.merge([stats.communication_stats(p) for p in compiled.programs.values()])
    return stats.communication_stats(compiled, mesh=mesh)


def _layout(state, batch) -> tuple:
    """What a step's program is compiled for: the inputs' structure, shapes, dtypes and
    shardings (not their values)."""
    leaves, tree = jax.tree.flatten((state, batch))
    return tree, tuple(
        (getattr(x, "shape", np.shape(x)), getattr(x, "dtype", type(x)),
         getattr(x, "sharding", None), getattr(x, "weak_type", False))
        for x in leaves
    )  # fmt: skip


class Program(NamedTuple):
    """One phase's program, and its two adapters between a ``StepState`` and its arguments.

    ``program(state, batch)`` runs it: ``outputs(state, fn(*inputs(state, batch)))``.

    Attributes:
      fn: the jitted function, or any callable with a ``lower`` that gives a
        ``jax.stages.Lowered`` or a ``LoweredPrograms``.
      inputs: ``(state, batch) -> arguments of fn``, the batch last.
      outputs: ``(state, result of fn) -> (new state, metrics)``; the new state's ``step``
        is set by ``TrainStep``.
    """

    fn: Callable
    inputs: Callable[[StepState, Any], tuple]
    outputs: Callable[[StepState, Any], tuple[StepState, dict[str, Any]]]

    def __call__(self, state: StepState, batch):
        return self.outputs(state, self.fn(*self.inputs(state, batch)))

    def lower(self, state: StepState, batch):
        return self.fn.lower(*self.inputs(state, batch))


class TrainStep:
    """A train step; the same calls for every algorithm.

    ``state = step.init(params)``, then ``state, metrics = step(state, batch)`` (or
    ``step.step(state, batch)``), ``step.params(state)`` for the model, ``step.lower(state,
    batch)``, ``step.communication_stats(state, batch)``, ``step.memory_stats(state,
    batch)``, ``step.phase_counts(state)``, and ``step.close()`` (or use it as a context
    manager). ``batch`` is this process's rows of the global batch (the whole batch with one
    process), as numpy or jax arrays, or arrays already sharded over the mesh by
    ``shard_batch``. ``metrics`` is ``{"loss": ...}`` (plus ``"aux"`` when the loss function
    has aux). ``step.on_divergence`` (``"warn"``, ``"raise"`` or ``"ignore"``) is what a
    diverging loss does (``guard.watch_loss``).

    The protocol is written here once; a subclass gives its phases and programs:

    ``phases``
        the names of its phases;
    ``_phase(steps_taken) -> (name, key)``
        the phase of the next step, and the key of its program;
    ``_build(key) -> Program``
        the program of a key, built once;
    ``_init(params)``, ``_state_shapes(params)``
        the state to start from, placed on the mesh, and the same as ``ShapeDtypeStruct``;
    ``_expected_opt_state(params)``
        the optimizer state ``init`` would make for ``params``, to refuse another step's
        state (None: not checked);
    ``_state_step``
        or instead of those three, the step whose state this one carries (the pipelined
        step's one-program step, async's first inner step);
    ``_params(state)``
        the model (``state.params`` unless overridden).
    """

    phases: tuple[str, ...] = ("step",)
    # The names ``state.extra`` holds besides the model's state and key.
    _extra_keys: tuple[str, ...] = ()
    _state_step: "TrainStep | None" = None

    def __init__(self, algorithm: str, mesh: Mesh, loss_fn, *, axes: tuple[str, str],
                 has_aux: bool, flatten: bool, donate: bool = False,
                 model: ModelState | None = None):  # fmt: skip
        for name, value in (("has_aux", has_aux), ("flatten", flatten), ("donate", donate)):
            checks.boolean(value, name, algorithm)
        nodes, local = checks.mesh_axes(mesh, *axes, algorithm)
        self.model = ModelState() if model is None else model
        self.algorithm, self.mesh, self.has_aux, self.flatten = algorithm, mesh, has_aux, flatten
        self._axes, self._donate = axes, donate
        self._devices = nodes * local  # over both axes: a row each of a per-device state
        self._unravel = None
        self.loss_fn = self._flat_loss(loss_fn) if flatten else loss_fn
        self._programs: dict[Any, Program] = {}
        # The executables memory_stats and communication_stats read: one layout's, by program.
        self._compiled: tuple[Any, dict[Any, Any]] = (None, {})
        self._checked: set[Any] = set()  # the state layouts _check_state has passed
        self._in_flight = StepsInFlight(mesh)
        self._on_divergence = "warn"
        self.loss_watch = guard.Watch()  # what guard.watch_loss keeps of this step's losses
        self._closed = False

    # What subclasses give. --------------------------------------------------------------

    def _phase(self, steps_taken: int) -> tuple[str, Any]:
        return "step", "step"

    def _build(self, key) -> Program:
        raise NotImplementedError

    def _init(self, params) -> StepState:
        return self._state_step._init(params)

    def _state_shapes(self, params) -> StepState:
        return self._state_step._state_shapes(params)

    def _expected_opt_state(self, params):
        return None if self._state_step is None else self._state_step._expected_opt_state(params)

    def _params(self, state: StepState):
        return state.params

    # The protocol. ------------------------------------------------------------------------

    @property
    def on_divergence(self) -> str:
        """What a diverging loss does: ``"warn"`` (a ``DivergenceWarning``, the default),
        ``"raise"`` (``FloatingPointError``) or ``"ignore"``.

        Raises:
          ValueError: when set to anything else.
        """
        return self._on_divergence

    @on_divergence.setter
    def on_divergence(self, mode: str) -> None:
        checks.one_of(mode, guard.ON_DIVERGENCE, "on_divergence", self.algorithm)
        self._on_divergence = mode

    def _flat_loss(self, loss_fn):
        # Bagua's flattened layout: the params (so the gradient and optimizer state) as one
        # vector; the loss function still sees the pytree.
        return lambda flat, batch, **kw: loss_fn(self._unravel(flat), batch, **kw)

    def init(self, params: optax.Params, batch=None) -> StepState:
        """The state to start from: ``params`` (the same on every process) placed, and the
        optimizer's and algorithm's state initialized on the mesh (with the model state and
        key of a step built with ``model_state=`` or ``rng_seed=``).

        ``batch``: a batch as ``step`` takes them (or its ``jax.ShapeDtypeStruct`` leaves,
        global shapes), for a ``shard="params"`` step whose loss marks layers with
        ``exchange_in_loop`` and whose sync keeps error feedback: the step traces the loss on
        it to lay out each marked layer's residuals. Any other step ignores it.

        Raises:
          ValueError: for a parameter that is not floating point, naming it.
        """
        checks.float_params(params, self.algorithm)
        if self.flatten:
            params, self._unravel = ravel_pytree(jax.device_get(params))
        state = self._init(params)
        if self.model.enabled:
            state = state._replace(extra={**state.extra, **self.model.place(self.mesh)})
        return state if batch is None else self._fit_state(state, batch, shapes=False)

    def _fit_state(self, state: StepState, batch, shapes: bool) -> StepState:
        """``state`` fitted to the loss as it runs on ``batch`` (``init``'s ``batch``);
        ``shapes``: whether ``state`` holds shapes only (``state_shapes``)."""
        del batch, shapes
        return state

    def _check_state(self, state) -> None:
        """Raises a ``ValueError`` naming both steps for a state another step made."""
        if not isinstance(state, StepState):
            raise ValueError(
                f"{self.algorithm}: state must be the StepState that step.init(params) or a "
                f"step returned, got {type(state).__name__}"
            )
        # Checked once per layout: the same tree and parameter shapes pass at once after.
        key = (
            jax.tree.structure(state),
            tuple((np.shape(x), getattr(x, "dtype", None)) for x in jax.tree.leaves(state.params)),
        )
        if key in self._checked:
            return
        checks.same_state(
            state, self._expected_opt_state(state.params), self._extra_keys, self.model,
            where=self.algorithm, devices=self._devices,
        )  # fmt: skip
        self._checked.add(key)

    def state_shapes(self, params: optax.Params, batch=None) -> StepState:
        """The ``StepState`` that ``init(params, batch)`` would return, as
        ``jax.ShapeDtypeStruct`` leaves with their shardings; allocates and runs nothing.

        With it, ``lower`` and ``communication_stats`` compile the step for a mesh whose
        devices are not here (``sharding.gpu_mesh``), or for a model too large to place.

        Args:
          params: the parameters, as arrays or ``jax.ShapeDtypeStruct`` leaves.
          batch: as ``init``'s (a batch, or its shapes).

        Returns:
          A ``StepState`` whose array leaves are ``ShapeDtypeStruct`` (``step`` is 0).

        Examples:
          >>> import jax, jax.numpy as jnp, optax, jax_bytegrad
          >>> mesh = jax_bytegrad.make_mesh(1, 1)
          >>> tx = optax.chain(jax_bytegrad.bytegrad(), optax.sgd(0.1))
          >>> step = jax_bytegrad.data_parallel_step(lambda w, b: jnp.sum(w * b), tx, mesh)
          >>> state = step.state_shapes(jax.ShapeDtypeStruct((4,), jnp.float32))
          >>> state.params.shape, int(state.step)
          ((4,), 0)
        """
        checks.float_params(params, self.algorithm)
        params = abstract(params)
        if self.flatten:
            captured = []

            def ravel(tree):
                flat, unravel = ravel_pytree(tree)
                captured.append(unravel)  # holds shapes and dtypes only
                return flat

            params = jax.eval_shape(ravel, params)
            self._unravel = captured[0]
        state = self._state_shapes(params)
        if self.model.enabled:
            state = state._replace(extra={**state.extra, **self.model.place_shapes(self.mesh)})
        return state if batch is None else self._fit_state(state, batch, shapes=True)

    def program(self, state: StepState) -> Program:
        """The program the next ``step(state, batch)`` runs."""
        _, key = self._phase(int(state.step))
        if key not in self._programs:
            self._programs[key] = self._build(key)
        return self._programs[key]

    def step(self, state: StepState, batch) -> tuple[StepState, dict[str, Any]]:
        """One train step: ``(state, batch) -> (state, metrics)``."""
        if self._closed:
            raise RuntimeError(f"{self.algorithm}: this train step was closed; build a new one")
        self._check_state(state)
        program = self.program(state)
        inputs = program.inputs(state, batch)
        # Before dispatch: jaxlib may crash the process on a buffer a donating step consumed.
        checks.not_deleted(inputs[:-1], self.algorithm)
        self._in_flight.wait()
        out = program.fn(*inputs)
        self._in_flight.track(out)
        new, metrics = program.outputs(state, out)
        new = new._replace(step=count(int(state.step) + 1))
        return guard.watch_loss(self, (new, metrics))  # warns once on divergence

    __call__ = step

    def params(self, state: StepState) -> optax.Params:
        """The model to evaluate or checkpoint, as a pytree of arrays over the mesh
        (replicated, or with ``shard="params"`` sharded within each node)."""
        params = self._params(state)
        return params if self._unravel is None else self._unravel(params)

    def device_key(self, state: StepState, device: int) -> jax.Array:
        """The key device ``device`` gets as ``key=`` in the step ``state`` is at (the next
        ``step(state, batch)``), computed outside the step, for a step built with
        ``rng_seed=``: to draw that device's dropout mask again, or check it.

        It is ``fold_in(fold_in(state.rng, state.step), device)``: nothing in it depends on
        what ran before, so a run restored from a checkpoint gets the same keys again.

        Args:
          state: a state of this step (``init``'s, a step's, or a restored one).
          device: the device's index over both mesh axes, node-major (``node * L + local``
            on a mesh of ``L`` devices per node).

        Returns:
          A typed PRNG key on this process.

        Raises:
          ValueError: for a step built without ``rng_seed=``, or a ``device`` outside the
            mesh.

        Examples:
          >>> import jax, jax.numpy as jnp, optax, jax_bytegrad
          >>> mesh = jax_bytegrad.make_mesh(1, 2)
          >>> def loss_fn(w, batch, *, key):
          ...     return jnp.mean(batch @ w) * jax.random.uniform(key)
          >>> strategy = jax_bytegrad.Strategy("gradient_allreduce", mesh=mesh)
          >>> with strategy.train_step(loss_fn, optax.sgd(0.1), rng_seed=0) as step:
          ...     state = step.init(jnp.ones(3))
          ...     key = step.device_key(state, 1)  # device 1's key in the first step
          >>> key.shape, jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
          ((), True)
        """
        if not self.model.has_rng:
            raise ValueError(
                f"{self.algorithm}: device_key needs a step built with rng_seed=...; this "
                "step gives the loss function no key"
            )
        self._check_state(state)
        if not isinstance(state.rng, jax.Array):
            raise ValueError(
                f"{self.algorithm}: device_key needs a state of arrays (init's, a step's or a "
                f"restored one), got state.rng of type {type(state.rng).__name__}"
            )
        last = self._devices - 1
        device = checks.integer(device, "device", self.algorithm, minimum=0, maximum=last)
        # Every process holds the whole key: fold it on this one, without a collective.
        rng = state.rng.addressable_data(0)
        return step_key(rng, int(state.step), device)

    def lower(self, state: StepState, batch) -> jax.stages.Lowered | LoweredPrograms:
        """Lowers the program the next step runs (as ``jax.jit(...).lower``); runs nothing.

        ``state`` may be ``state_shapes(params)`` and ``batch`` a pytree of
        ``jax.ShapeDtypeStruct`` (the global batch): ``.compile()`` on the result then
        compiles for the mesh, whether its devices are here or not (``sharding.gpu_mesh``).

        Returns:
          A ``jax.stages.Lowered`` for a step of one program per step (every algorithm but
          ``pipelined_step``); for ``pipelined_step``, whose step runs several programs, a
          ``LoweredPrograms``: the same ``.compile()`` and ``.as_text()``, and each
          program's ``Lowered`` by name in ``.programs``. Either way ``.compile().as_text()``
          is what XLA runs.
        """
        self._check_state(state)
        return self.program(state).lower(state, batch)

    def _compile(self, key, lower: Callable[[], Any], state: StepState, batch):
        """``lower().compile()``, once per program ``key`` and inputs' layout: the step keeps
        the last layout's executables, so ``memory_stats`` and ``communication_stats`` of one
        state and batch read one compile (up to minutes for a large model)."""
        layout = _layout(state, batch)
        if self._compiled[0] != layout:
            self._compiled = (layout, {})
        cache = self._compiled[1]
        if key not in cache:
            cache[key] = lower().compile()
        return cache[key]

    def _compiled_phases(self, state: StepState, batch) -> dict[str, Any]:
        """Each phase's compiled program, by phase: the phase of the step ``state`` is at from
        the program that step runs, every other phase from its first step."""
        self._check_state(state)
        out = {}
        now = self._phase(int(state.step))[0]
        for example in self._phase_examples():
            taken = int(state.step) if self._phase(example)[0] == now else example
            name, key = self._phase(taken)
            at = state._replace(step=count(taken))
            out[name] = self._compile(key, lambda at=at: self.program(at).lower(state, batch),
                                      state, batch)  # fmt: skip
        return out

    def communication_stats(self, state: StepState, batch) -> dict[str, stats.CommunicationStats]:
        """Bytes each device sends per step, for each phase, and the compute that runs beside
        them; compiles (once with ``memory_stats``: the same state and batch reuse the
        executable), runs nothing.

        The phase of the step ``state`` is at is read from the program that step runs; every
        other phase from its first step. A step of several programs (``pipelined_step``)
        counts all of them.

        Returns:
          ``{phase: CommunicationStats}``: ``{"step": ...}`` for a step with one program;
          QAdam's ``{"warmup": ..., "compressed": ...}``; the decentralized pair's
          ``{"gossip": ...}`` plus ``"local"`` when some steps do not communicate; async's
          ``{"step": ..., "averaging": ...}`` (one background round, on a mesh of its own).
          ``phase_counts`` says how often each has run.
        """
        compiled = self._compiled_phases(state, batch)
        return {name: _communication(one, self.mesh) for name, one in compiled.items()}

    def bytes_between_nodes(self, state: StepState, batch) -> dict[str, float]:
        """Bytes each device sends over the links between nodes per step, for each phase
        (``communication_stats``' phases, ``bytes_on`` the node axis); compiles, runs nothing.
        Asked the same way of every step; DiLoCo's adds ``"per_inner_step"``, the average over
        its period of inner and outer steps. Multiply by the devices per node for what a node
        sends.

        Returns:
          ``{phase: bytes}``.
        """
        node = self._axes[0]
        return {
            name: one.bytes_on(node) for name, one in self.communication_stats(state, batch).items()
        }

    def memory_stats(self, state: StepState, batch) -> dict[str, memory.MemoryStats]:
        """Memory each device needs to run a step, per phase, from XLA's memory analysis of
        the compiled program; compiles (once with ``communication_stats``), runs nothing.

        With ``state = step.state_shapes(params)`` and a batch of ``jax.ShapeDtypeStruct``
        on a deviceless mesh (``sharding.gpu_mesh``), it says before any GPU is rented
        whether the step fits, and with which ``shard=``: ``fits()`` compares with the
        device's memory, and warns when XLA's rematerialization fell short of its target.

        Returns:
          ``{phase: MemoryStats}``, phases as ``communication_stats`` names them.
        """
        compiled = self._compiled_phases(state, batch)
        return {name: memory.of_compiled(one) for name, one in compiled.items()}

    def _phase_examples(self) -> list[int]:
        """One step count of each phase: the first, searching forward."""
        found: dict[str, int] = {}
        for taken in range(_PHASE_SEARCH):
            found.setdefault(self._phase(taken)[0], taken)
            if len(found) == len(self.phases):
                return sorted(found.values())
        raise RuntimeError(
            f"{self.algorithm}: phases {sorted(set(self.phases) - set(found))} do not occur in "
            f"the first {_PHASE_SEARCH} steps"
        )

    def phase_counts(self, state: StepState) -> dict[str, int]:
        """How many of the steps taken up to ``state`` ran each phase.

        Multiplying each phase's bytes (``communication_stats``) by its count gives the
        traffic of the run so far.
        """
        counts = collections.Counter(self._phase(i)[0] for i in range(int(state.step)))
        return {name: counts.get(name, 0) for name in self.phases}

    def close(self) -> None:
        """Releases what the step holds (async: stops the background averaging, on every
        process). Calling it again does nothing."""
        self._closed = True

    def __enter__(self) -> "TrainStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def global_batch(batch, mesh: Mesh, axes: tuple[str, str]):
    """This process's rows as a batch sharded over every device; sharded arrays pass as is,
    and a batch of ``jax.ShapeDtypeStruct`` (to lower or compile a step) is the global batch,
    given the batch's sharding."""
    leaves = jax.tree.leaves(batch)
    if leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        sharding = NamedSharding(mesh, P(axes))
        checks.batch_splits(batch, mesh.shape[axes[0]] * mesh.shape[axes[1]], "train step",
                            owner="the devices of the mesh")  # fmt: skip
        return abstract(batch, sharding)
    return shard_batch(batch, mesh, node_axis=axes[0], local_axis=axes[1], where="train step")
