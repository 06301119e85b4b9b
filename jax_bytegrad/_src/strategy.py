"""One entry point for the six algorithms, by Bagua's names.

Follows Bagua's strategy for PyTorch Lightning (``BaguaStrategy(algorithm=...,
**algorithm_kwargs)``; Gan et al., "Bagua: Scaling up Distributed Learning with System
Relaxations", VLDB 2022): one object, one string to switch algorithm, and the remaining
keyword arguments handed to the algorithm. Here that object builds a train step with the same
shape for every algorithm::

    strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh)
    with strategy.train_step(loss_fn, optax.adam(1e-3), has_aux=True) as step:
        state = step.init(params)
        for batch in batches:
            state, metrics = step(state, batch)
    params = step.params(state)

The builders it wraps stay public for users who write their own steps:
``data_parallel_step`` with ``bytegrad()``/``gradient_allreduce()``/``qadam()``,
``decentralized_step``, ``low_precision_decentralized_step`` and ``async_model_average``.
"""

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_bytegrad._src import async_averaging, decentralized, parallel, stats, transforms
from jax_bytegrad._src import checks as _checks
from jax_bytegrad._src import qadam as qadam_optimizer

# Bagua's algorithm names, in the order its documentation lists them.
ALGORITHMS = (
    "gradient_allreduce",
    "bytegrad",
    "qadam",
    "decentralized",
    "low_precision_decentralized",
    "async",
)

# Arguments the entry point passes itself; never algorithm keyword arguments.
_SUPPLIED = frozenset({"loss_fn", "optimizer", "mesh", "has_aux"})


# Private helpers -------------------------------------------------------------------------


def _builders(algorithm: str) -> tuple[Callable, ...]:
    """The library functions an algorithm is built from; their signatures define its kwargs.

    Looked up when called, so a keyword argument added to a builder works here unchanged.
    """
    if algorithm == "gradient_allreduce":
        return transforms.gradient_allreduce, parallel.data_parallel_step
    if algorithm == "bytegrad":
        return transforms.bytegrad, parallel.data_parallel_step
    if algorithm == "qadam":
        return qadam_optimizer.qadam, parallel.data_parallel_step
    if algorithm == "decentralized":
        return (decentralized.decentralized_step,)
    if algorithm == "low_precision_decentralized":
        return (decentralized.low_precision_decentralized_step,)
    return (async_averaging.async_model_average,)


def _parameters(builder: Callable) -> dict[str, inspect.Parameter]:
    return {
        name: p
        for name, p in inspect.signature(builder).parameters.items()
        if name not in _SUPPLIED and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def _check_algorithm(algorithm) -> None:
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"Strategy: unknown algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}"
        )


def _bind(builder: Callable, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The share of ``kwargs`` that ``builder`` takes."""
    return {k: v for k, v in kwargs.items() if k in _parameters(builder)}


def _missing(builder: Callable, kwargs: Mapping[str, Any]) -> list[str]:
    return [
        name
        for name, p in _parameters(builder).items()
        if p.default is p.empty and name not in kwargs
    ]


def _global_batch(batch, mesh: Mesh, axes: tuple[str, str]):
    """This process's rows as a batch sharded over every device; sharded arrays pass as they are."""
    sharding = NamedSharding(mesh, P(axes))
    leaves = jax.tree.leaves(batch)
    if all(
        isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim) for x in leaves
    ):
        return batch
    return parallel.shard_batch(batch, mesh, node_axis=axes[0], local_axis=axes[1])


def _host_copy(tree):
    """A host copy of ``tree``: the state a step donates must not share the caller's buffers."""
    return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))


@jax.jit
def _device_mean(tree):
    """Mean over the leading (device) axis: decentralized losses as one number."""
    return jax.tree.map(lambda x: jnp.mean(x, axis=0), tree)


class _Flat:
    """Bagua's flattened layout: the params (so the gradient and optimizer state) as one vector.

    The loss function still sees the pytree: ``wrap`` unflattens inside it, and the gradient
    of those slices comes back as one vector. XLA:CPU runs the optimizer's update as one
    kernel per leaf; on one vector an optax Adam step of 400 small leaves ran 3x faster
    (3-6x across runs; benchmarks/RESULTS.md, "Flattened optimizer").
    """

    def __init__(self):
        self.unravel = None

    def ravel(self, params):
        flat, self.unravel = ravel_pytree(params)
        return flat

    def wrap(self, loss_fn):
        return lambda flat, batch: loss_fn(self.unravel(flat), batch)


def _metrics(loss, aux, has_aux: bool) -> dict[str, Any]:
    return {"loss": loss, "aux": aux} if has_aux else {"loss": loss}


def _count(n: int) -> np.ndarray:
    return np.asarray(n, np.int64)


# State -----------------------------------------------------------------------------------


class TrainState(NamedTuple):
    """What a ``Strategy`` train step carries from one step to the next; a pytree.

    Orbax checkpoints it as it is (``StandardCheckpointer().save(path, state)``) and restores
    it onto ``step.init(params)`` as the target, for every algorithm but ``async`` (whose
    processes hold different models by design: checkpoint ``step.params(state)`` instead).

    Attributes:
      step: steps taken, a 0-d int64 numpy array (host side: the decentralized algorithms
        pick their communication round from it without a device round trip).
      params: the parameters: replicated for ``gradient_allreduce``, ``bytegrad``, ``qadam``
        and ``async``; one copy per device, stacked on a leading axis, for the decentralized
        pair (``step.params(state)`` averages them).
      opt_state: the optimizer state, laid out like ``params`` (it holds ByteGrad's and
        QAdam's own state).
      extra: the algorithm's state beyond those two, by name (the peers' weights of
        ``low_precision_decentralized``); empty for the others.
    """

    step: np.ndarray
    params: optax.Params
    opt_state: optax.OptState
    extra: dict[str, Any]


# Train steps -----------------------------------------------------------------------------


class TrainStep:
    """A train step built by ``Strategy.train_step``; the same calls for every algorithm.

    ``init(params) -> state``, ``step(state, batch) -> (state, metrics)``,
    ``params(state) -> params``, ``communication_stats(state, batch)``, and ``close()``
    (or use it as a context manager). ``batch`` is this process's rows of the global batch
    (the whole batch with one process), as numpy or jax arrays, or arrays already sharded
    over the mesh by ``shard_batch``. ``metrics`` is ``{"loss": ...}`` (plus ``"aux"`` with
    ``has_aux``), see ``Strategy.train_step`` for what the loss is a mean over.
    """

    algorithm: str
    mesh: Mesh

    def __init__(self, algorithm: str, mesh: Mesh, has_aux: bool):
        self.algorithm, self.mesh, self.has_aux = algorithm, mesh, has_aux
        self._closed = False
        self._flat: _Flat | None = None

    def init(self, params: optax.Params) -> TrainState:
        """The state to start from: ``params`` (the same on every process) placed, and the
        optimizer's and algorithm's state initialized."""
        if self._flat is not None:
            params = self._flat.ravel(jax.device_get(params))
        return self._init(params)

    def _init(self, params):
        raise NotImplementedError

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict[str, Any]]:
        if self._closed:
            raise RuntimeError(
                f"Strategy({self.algorithm!r}): this train step was closed; build a new one "
                "with strategy.train_step(...)"
            )
        return self._step(state, batch)

    def _step(self, state, batch):
        raise NotImplementedError

    def params(self, state: TrainState) -> optax.Params:
        """The model to evaluate or checkpoint, replicated over the mesh, as a pytree."""
        params = self._params(state)
        return params if self._flat is None else self._flat.unravel(params)

    def _params(self, state):
        return state.params

    def lower(self, state: TrainState, batch):
        """Lowers the compiled step program (as ``jax.jit(...).lower``)."""
        raise NotImplementedError

    def communication_stats(self, state: TrainState, batch) -> dict[str, stats.CommunicationStats]:
        """Bytes each device sends per step, by phase; compiles but runs nothing.

        Returns:
          ``{"step": stats}`` for most algorithms. QAdam runs two phases in one program and
          gets ``{"warmup": ..., "compressed": ...}``: the float32 all-reduce of its warm-up
          steps and the 8-bit momentum exchange after it, each measured on its own program
          (a float32 gradient mean, and ByteGrad's exchange with QAdam's settings). Async
          gets ``{"step": ..., "averaging": ...}``: its local step, and one round of the
          background averaging (a float32 all-reduce of the model between processes).
          ``phase_counts`` says how often each has run.
        """
        return {"step": stats.communication_stats(self.lower(state, batch), mesh=self.mesh)}

    def phase_counts(self, state: TrainState) -> dict[str, int]:
        """How many times each phase of ``communication_stats`` has run up to ``state``.

        Multiplying each phase's bytes by its count gives the traffic of the run so far.
        """
        return {"step": int(state.step)}

    def close(self) -> None:
        """Releases what the step holds (async: stops the background averaging, on every
        process). Calling it again does nothing."""
        self._closed = True

    def __enter__(self) -> "TrainStep":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ReplicatedStep(TrainStep):
    """gradient_allreduce, bytegrad and qadam: ``data_parallel_step`` around one optimizer."""

    def __init__(self, algorithm, mesh, has_aux, loss_fn, tx, step_kwargs, phases, warmup_steps):
        super().__init__(algorithm, mesh, has_aux)
        self._warmup_steps = warmup_steps
        self._tx = tx
        self._loss_fn = loss_fn
        self._step_kwargs = step_kwargs
        self._axes = (step_kwargs.get("node_axis", "node"), step_kwargs.get("local_axis", "local"))
        self._dp = parallel.data_parallel_step(loss_fn, tx, mesh, has_aux=has_aux, **step_kwargs)
        self._init_opt = jax.jit(tx.init, out_shardings=NamedSharding(mesh, P()))
        self._phases = phases

    def _init(self, params):
        params = parallel.replicate(_host_copy(params), self.mesh)
        return TrainState(_count(0), params, self._init_opt(params), {})

    def _step(self, state, batch):
        batch = _global_batch(batch, self.mesh, self._axes)
        out = self._dp(state.params, state.opt_state, batch)
        params, opt_state, loss = out[:3]
        aux = out[3] if self.has_aux else None
        new = TrainState(_count(int(state.step) + 1), params, opt_state, {})
        return new, _metrics(loss, aux, self.has_aux)

    def lower(self, state, batch):
        batch = _global_batch(batch, self.mesh, self._axes)
        return self._dp.lower(state.params, state.opt_state, batch)

    def phase_counts(self, state):
        if self._phases is None:
            return super().phase_counts(state)
        steps = int(state.step)
        warm = min(steps, self._warmup_steps)
        return {"warmup": warm, "compressed": steps - warm}

    def communication_stats(self, state, batch):
        if self._phases is None:
            return super().communication_stats(state, batch)
        batch = _global_batch(batch, self.mesh, self._axes)
        out = {}
        for phase, tx in self._phases.items():
            dp = parallel.data_parallel_step(
                self._loss_fn, tx, self.mesh, has_aux=self.has_aux, **self._step_kwargs
            )
            opt_state = jax.eval_shape(tx.init, state.params)
            lowered = dp.lower(state.params, opt_state, batch)
            out[phase] = stats.communication_stats(lowered, mesh=self.mesh)
        return out


class _DecentralizedStep(TrainStep):
    """decentralized and low_precision_decentralized: one model per device."""

    def __init__(self, algorithm, mesh, has_aux, train, axes):
        super().__init__(algorithm, mesh, has_aux)
        self._train = train
        self._axes = axes
        self._state_type = None

    def _inner(self, state):
        return self._state_type(
            params=state.params, opt_state=state.opt_state, step=int(state.step), **state.extra
        )

    def _outer(self, inner):
        self._state_type = type(inner)
        extra = {
            f: getattr(inner, f) for f in inner._fields if f not in ("params", "opt_state", "step")
        }
        return TrainState(_count(inner.step), inner.params, inner.opt_state, extra)

    def _init(self, params):
        return self._outer(self._train.init(params))

    def _step(self, state, batch):
        batch = _global_batch(batch, self.mesh, self._axes)
        out = self._train.step(self._inner(state), batch)
        loss = _device_mean(out[1])
        aux = _device_mean(out[2]) if self.has_aux else None
        return self._outer(out[0]), _metrics(loss, aux, self.has_aux)

    def _params(self, state):
        return decentralized.consensus_params(state.params)

    def lower(self, state, batch):
        batch = _global_batch(batch, self.mesh, self._axes)
        return self._train.step.lower(self._inner(state), batch)


class _AsyncStep(TrainStep):
    """async: local steps per process, the model averaged between processes in a thread."""

    def __init__(self, algorithm, mesh, has_aux, averager):
        super().__init__(algorithm, mesh, has_aux)
        self._avg = averager

    def _init(self, params):
        params, opt_state = self._avg.init(params, start=True)
        return TrainState(_count(self._avg.step_id), params, opt_state, {})

    def _step(self, state, batch):
        out = self._avg.step(state.params, state.opt_state, batch)
        params, opt_state, loss = out[:3]
        aux = out[3] if self.has_aux else None
        new = TrainState(_count(self._avg.step_id), params, opt_state, {})
        return new, _metrics(loss, aux, self.has_aux)

    def _params(self, state):
        """The exact average of the processes' models, replicated over the whole mesh.

        A collective: every process calls it, after ``close()``.

        Raises:
          RuntimeError: while the background averaging runs (close the step first).
        """
        if not self._closed:
            raise RuntimeError(
                "Strategy('async'): params(state) averages the model over processes once, "
                "exactly, which cannot run beside the background averaging; call step.close() "
                "first (on every process)"
            )
        params = self._avg.average_now(state.params)
        return parallel.replicate(jax.device_get(params), self.mesh)

    def lower(self, state, batch):
        return self._avg.lower(state.params, state.opt_state, batch)

    def communication_stats(self, state, batch):
        # Each program is laid out over a mesh of its own (this process's devices; one device
        # per process), read from its shardings.
        return {
            "step": stats.communication_stats(self.lower(state, batch)),
            "averaging": stats.communication_stats(self._avg.lower_averaging()),
        }

    def phase_counts(self, state):
        return {"step": int(state.step), "averaging": self._avg.round_stats.rounds}

    def close(self):
        if not self._closed:
            self._avg.abort()
        super().close()


# The entry point -------------------------------------------------------------------------


def valid_kwargs(algorithm: str) -> tuple[str, ...]:
    """The keyword arguments ``Strategy(algorithm, ...)`` accepts, read from its builders.

    Args:
      algorithm: one of ``ALGORITHMS``.

    Returns:
      The names, sorted.

    Raises:
      ValueError: for an unknown algorithm.

    Examples:
      >>> import jax_bytegrad
      >>> "sync_interval_ms" in jax_bytegrad.valid_kwargs("async")
      True
    """
    _check_algorithm(algorithm)
    names = set()
    for builder in _builders(algorithm):
        names.update(_parameters(builder))
    return tuple(sorted(names))


class Strategy:
    """Bagua's algorithms behind one entry point: switch algorithm by changing one string.

    Args:
      algorithm: one of ``ALGORITHMS``: ``"gradient_allreduce"``, ``"bytegrad"``,
        ``"qadam"``, ``"decentralized"``, ``"low_precision_decentralized"``, ``"async"``.
      mesh: from ``make_mesh``; by default ``make_mesh()`` (one node per process).
      flatten: keep the params, gradient and optimizer state as one float32 vector (Bagua's
        fused optimizer; Lightning's ``BaguaStrategy(flatten=True)``); the loss function
        still gets the pytree. It made an Adam step over 400 small leaves about 3x faster
        on CPU. ByteGrad then sends the model as one bucket (one message per collective),
        and mixed-dtype params are held in their common dtype.
      **algorithm_kwargs: the algorithm's options, passed on by name to the function that
        builds it (``valid_kwargs(algorithm)`` lists them). For ``gradient_allreduce``,
        ``bytegrad`` and ``qadam`` those are the transform's (``bytegrad()``, ...) and
        ``data_parallel_step``'s (``donate``, ``node_axis``, ``local_axis``); for the others,
        their step builder's (``decentralized_step``, ``low_precision_decentralized_step``,
        ``async_model_average``, e.g. ``sync_interval_ms``). ``qadam`` is a whole optimizer:
        its ``learning_rate`` and ``warmup_steps`` (and ``b1``, ``b2``, ``eps``,
        ``weight_decay``) go here, and ``train_step`` takes no optimizer.

    Raises:
      ValueError: for an unknown algorithm, an argument the algorithm does not take (the
        message lists those it does), a required one missing, or (for the transforms) a bad
        value, at construction.

    Examples:
      >>> import jax.numpy as jnp, optax, jax_bytegrad
      >>> strategy = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(1, 1))
      >>> loss_fn = lambda w, b: jnp.mean((b * w) ** 2)
      >>> with strategy.train_step(loss_fn, optax.sgd(0.1)) as step:
      ...     state = step.init(jnp.ones(4))
      ...     state, metrics = step(state, jnp.ones((8, 4)))
      >>> int(state.step), float(metrics["loss"])
      (1, 1.0)

    References:
      Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
    """

    def __init__(
        self,
        algorithm: str,
        *,
        mesh: Mesh | None = None,
        flatten: bool = False,
        **algorithm_kwargs: Any,
    ):
        _check_algorithm(algorithm)
        _checks.boolean(flatten, "flatten", "Strategy")
        valid = valid_kwargs(algorithm)
        unknown = sorted(set(algorithm_kwargs) - set(valid))
        if unknown:
            raise ValueError(
                f"Strategy({algorithm!r}): unknown keyword argument(s) {', '.join(unknown)}; "
                f"{algorithm} takes {', '.join(valid)}"
            )
        builders = _builders(algorithm)
        missing = _missing(builders[0], algorithm_kwargs)
        if missing:
            raise ValueError(
                f"Strategy({algorithm!r}): missing keyword argument(s) {', '.join(missing)}; "
                f"pass them, e.g. Strategy({algorithm!r}, {missing[0]}=...)"
            )
        self.algorithm = algorithm
        self.mesh = parallel.make_mesh() if mesh is None else mesh
        self.kwargs = dict(algorithm_kwargs)
        self.flatten = flatten
        # The transforms validate their arguments now, at construction, not at the first step.
        self._sync = None
        if len(builders) > 1:
            sync_kwargs = _bind(builders[0], self.kwargs)
            if "mesh" in inspect.signature(builders[0]).parameters:
                sync_kwargs["mesh"] = self.mesh  # bytegrad's error feedback sizes state by it
            self._sync = builders[0](**sync_kwargs)

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.kwargs.items())
        return f"Strategy({self.algorithm!r}, mesh={dict(self.mesh.shape)}{args})"

    def replace(self, **algorithm_kwargs: Any) -> "Strategy":
        """A strategy like this one with some algorithm keyword arguments changed or added.

        Examples:
          >>> import jax_bytegrad
          >>> s = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(1, 1), bits=4)
          >>> s.replace(message_bytes=2**20).kwargs
          {'bits': 4, 'message_bytes': 1048576}
        """
        kwargs = {**self.kwargs, **algorithm_kwargs}
        return Strategy(self.algorithm, mesh=self.mesh, flatten=self.flatten, **kwargs)

    def setting(self, name: str) -> Any:
        """The value the algorithm runs with for keyword ``name``: the one given, else the
        default of the function that takes it.

        Raises:
          ValueError: for a name the algorithm does not take.

        Examples:
          >>> import jax_bytegrad
          >>> s = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(1, 1))
          >>> s.setting("bits"), s.setting("message_bytes")
          (8, 262144)
        """
        if name in self.kwargs:
            return self.kwargs[name]
        for builder in _builders(self.algorithm):
            parameter = _parameters(builder).get(name)
            if parameter is not None and parameter.default is not parameter.empty:
                return parameter.default
        raise ValueError(
            f"Strategy({self.algorithm!r}): no setting {name!r}; "
            f"{self.algorithm} takes {', '.join(valid_kwargs(self.algorithm))}"
        )

    def train_step(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation | None = None,
        *,
        has_aux: bool = False,
    ) -> TrainStep:
        """Builds the train step of this strategy's algorithm.

        Args:
          loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``),
            computed on one device's slice of the batch.
          optimizer: the optax optimizer (``optax.adam(1e-3)``); the algorithm adds its own
            communication. None for ``qadam``, which is the optimizer itself.
          has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

        Returns:
          A ``TrainStep``: ``state = step.init(params)``, ``state, metrics = step(state,
          batch)``, ``step.params(state)``, ``step.close()``. ``metrics["loss"]`` (and the
          float leaves of ``metrics["aux"]``) are means over every device of the mesh for all
          algorithms but ``async``, where they are means over this process's devices (its
          processes train on their own). For the decentralized pair each device's loss is
          taken at its own weights before the exchange.

        Raises:
          ValueError: for an optimizer given to ``qadam`` or missing for the others, or
            (decentralized and async) a bad algorithm argument.
        """
        name = self.algorithm
        if name == "qadam" and optimizer is not None:
            raise ValueError(
                "Strategy('qadam'): qadam is the optimizer itself (Adam with an 8-bit momentum "
                "exchange), so train_step takes optimizer=None; pass its settings to the "
                "strategy: Strategy('qadam', learning_rate=1e-3, warmup_steps=100, ...)"
            )
        if name != "qadam" and not isinstance(optimizer, optax.GradientTransformation):
            raise ValueError(
                f"Strategy({name!r}): optimizer must be an optax.GradientTransformation such "
                f"as optax.adam(1e-3), got {optimizer!r}"
            )
        flat = _Flat() if self.flatten else None
        step = self._build(name, flat.wrap(loss_fn) if flat else loss_fn, optimizer, has_aux)
        step._flat = flat
        return step

    def _build(self, name, loss_fn, optimizer, has_aux) -> TrainStep:
        builders = _builders(name)
        if self._sync is not None:
            step_kwargs = _bind(builders[1], self.kwargs)
            tx = self._sync if name == "qadam" else optax.chain(self._sync, optimizer)
            warmup = self.kwargs.get("warmup_steps", 0) if name == "qadam" else 0
            return _ReplicatedStep(
                name, self.mesh, has_aux, loss_fn, tx, step_kwargs, self._qadam_phases(), warmup
            )
        kwargs = _bind(builders[0], self.kwargs)
        built = builders[0](loss_fn, optimizer, self.mesh, has_aux=has_aux, **kwargs)
        if name == "async":
            return _AsyncStep(name, self.mesh, has_aux, built)
        axes = (kwargs.get("node_axis", "node"), kwargs.get("local_axis", "local"))
        return _DecentralizedStep(name, self.mesh, has_aux, built, axes)

    def _qadam_phases(self) -> dict[str, optax.GradientTransformation] | None:
        """Stand-ins with QAdam's communication of each phase, for ``communication_stats``."""
        if self.algorithm != "qadam":
            return None
        sync = {k: v for k, v in self.kwargs.items() if k in _parameters(transforms.bytegrad)}
        full = {k: v for k, v in sync.items() if k in _parameters(transforms.gradient_allreduce)}
        # QAdam's own default, which gradient_allreduce's need not share.
        full.setdefault("hierarchical", _parameters(qadam_optimizer.qadam)["hierarchical"].default)
        return {
            "warmup": optax.chain(transforms.gradient_allreduce(**full), optax.adam(0.0)),
            # mesh: with error feedback the stand-in sizes its residuals as QAdam does.
            "compressed": optax.chain(transforms.bytegrad(mesh=self.mesh, **sync), optax.adam(0.0)),
        }
