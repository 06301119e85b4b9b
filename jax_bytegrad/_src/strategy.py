"""One entry point for the six algorithms, by Bagua's names: a registry of algorithms.

Follows Bagua's strategy for PyTorch Lightning (``BaguaStrategy(algorithm=...,
**algorithm_kwargs)``; Gan et al., "Bagua: Scaling up Distributed Learning with System
Relaxations", VLDB 2022): one object, one string to switch algorithm, and the remaining
keyword arguments handed to the algorithm. Each entry of the registry names the settings the
algorithm takes (with their defaults), those ``autotune`` may change, and how to build its
``TrainStep``::

    strategy = jax_bytegrad.Strategy("bytegrad", mesh=mesh)
    with strategy.train_step(loss_fn, optax.adam(1e-3), has_aux=True) as step:
        state = step.init(params)
        for batch in batches:
            state, metrics = step(state, batch)
    params = step.params(state)

The builders stay public for users who write their own steps: ``data_parallel_step`` with
``bytegrad()``/``gradient_allreduce()``/``qadam()``, ``decentralized_step``,
``low_precision_decentralized_step`` and ``experimental.async_model_average``.
"""

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import optax
from jax.sharding import Mesh

from jax_bytegrad._src import checks, guard, qadam, transforms
from jax_bytegrad._src import mesh as mesh_lib
from jax_bytegrad._src.sharding.placement import check_shard
from jax_bytegrad._src.steps import asynchronous, decentralized, diloco, pipelined
from jax_bytegrad._src.steps.accumulation import Accumulation
from jax_bytegrad._src.steps.base import TrainStep
from jax_bytegrad._src.steps.data_parallel import DataParallelStep, data_parallel_step
from jax_bytegrad._src.steps.loop_exchange import LoopSync
from jax_bytegrad._src.steps.model_state import ModelState, StateSync
from jax_bytegrad._src.sync import collectives
from jax_bytegrad._src.sync.config import SyncConfig

# Private helpers -------------------------------------------------------------------------

# A setting without a default: the strategy must be given it.
REQUIRED = object()


def _defaults(builder, *, only=None, without=()) -> dict[str, Any]:
    """The keyword arguments of ``builder`` (those in ``only``, if given, but those in
    ``without``), each with its default, ``REQUIRED`` where it has none: read from the
    signature, so the registry never restates a default."""
    out = {}
    for p in inspect.signature(builder).parameters.values():
        if (only is None or p.name in only) and p.name not in without:
            out[p.name] = REQUIRED if p.default is inspect.Parameter.empty else p.default
    return out


# What train_step passes itself, or the strategy decides: never a setting.
_GIVEN = ("loss_fn", "optimizer", "mesh", "has_aux", "flatten", "phase", "phase_of")
_GIVEN += ("model_state", "rng_seed", "state_sync")
# The data-parallel step's own settings, besides the transform's.
_STEP = _defaults(data_parallel_step, only=("donate", "node_axis", "local_axis", "shard"))
_SYNC = _defaults(transforms.bytegrad, without=_GIVEN)
_ALLREDUCE = _defaults(transforms.gradient_allreduce, without=_GIVEN)
_QADAM = _defaults(qadam.qadam, without=_GIVEN)
_SYNC_CONFIG = tuple(f.name for f in dataclasses.fields(SyncConfig))


def _pick(kwargs: Mapping[str, Any], names) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k in names}


def _loop_sync(s: "Strategy", *, compressed: bool, reduce_dtype=None, b1=None) -> LoopSync | None:
    """What a ``shard="params"`` step of ``s`` runs on a layer marked ``exchange_in_loop``
    (and a ``shard="full"`` step on every layer's gradient): the sync of its optimizer, with
    the same settings (``b1``: of the momentum, as ``LoopSync``); None for another
    ``shard=``."""
    if s.setting("shard") not in ("params", "full"):
        return None
    names = _SYNC_CONFIG if compressed else ("node_axis", "local_axis")
    config = SyncConfig(**_pick(s.kwargs, names), where=s.algorithm)
    average = s.setting("average") if "average" in _entry(s.algorithm).settings else True
    return LoopSync(config, compressed, average, reduce_dtype, b1)


def _data_parallel(s: "Strategy", loss_fn, optimizers, phase_of, has_aux, model,
                   loop_syncs=None) -> TrainStep:  # fmt: skip
    """The data-parallel step of ``s``, named after its algorithm."""
    model = dict(model)
    accumulation = model.pop("accumulation", None)
    step = {k: s.setting(k) for k in _STEP}
    return DataParallelStep(
        s.algorithm,
        loss_fn,
        optimizers,
        phase_of,
        s.mesh,
        has_aux=has_aux,
        donate=step["donate"],
        axes=(step["node_axis"], step["local_axis"]),
        flatten=s.flatten,
        model=ModelState.of(*model.values(), f"Strategy({s.algorithm!r})"),
        shard=step["shard"],
        accumulation=accumulation,
        loop_syncs=loop_syncs,
    )


def _single(optimizer) -> tuple[dict, Callable[[int], str]]:
    return {"step": optimizer}, lambda _: "step"


def _build_gradient_allreduce(s: "Strategy", loss_fn, optimizer, has_aux, **model) -> TrainStep:
    sync = transforms.gradient_allreduce(**_pick(s.kwargs, _ALLREDUCE))
    reduce_dtype = collectives.reduce_dtype_of(s.setting("reduce_dtype"), s.algorithm)
    loop = {"step": _loop_sync(s, compressed=False, reduce_dtype=reduce_dtype)}
    return _data_parallel(s, loss_fn, *_single(optax.chain(sync, optimizer)), has_aux, model, loop)


def _refuse_model(model, where: str, why: str) -> None:
    ModelState.of(model["model_state"], model["rng_seed"], model["state_sync"], where).refuse(
        where, why
    )


def _build_bytegrad(s: "Strategy", loss_fn, optimizer, has_aux, **model) -> TrainStep:
    if s.setting("pipeline"):
        where = "Strategy('bytegrad', pipeline=True)"
        if "accumulation" in model:
            raise ValueError(f"{where} does not accumulate micro-steps; use pipeline=False")
        _refuse_model(model, where, "its programs carry the params and optimizer state only")
        return pipelined.PipelinedStep(
            "bytegrad",
            loss_fn,
            optimizer,
            s.mesh,
            sync=SyncConfig(**_pick(s.kwargs, _SYNC_CONFIG), where="bytegrad"),
            average=s.setting("average"),
            seed=s.setting("seed"),
            has_aux=has_aux,
            donate=s.setting("donate"),
            flatten=s.flatten,
        )
    sync = transforms.bytegrad(mesh=s.mesh, **_pick(s.kwargs, _SYNC))
    loop = {"step": _loop_sync(s, compressed=True)}
    return _data_parallel(s, loss_fn, *_single(optax.chain(sync, optimizer)), has_aux, model, loop)


def _build_qadam(s: "Strategy", loss_fn, optimizer, has_aux, **model) -> TrainStep:
    del optimizer  # QAdam is the optimizer
    kwargs = _pick(s.kwargs, _QADAM)
    phases = {
        phase: qadam.qadam(mesh=s.mesh, phase=phase, **kwargs) for phase in ("warmup", "compressed")
    }
    if s.setting("skip_nonfinite"):
        # The update is the same on every replica, so every replica skips the same steps.
        phases = {phase: guard.skip_nonfinite(tx) for phase, tx in phases.items()}
    phase_of = qadam.phase_schedule(
        s.setting("warmup_steps"),
        s.setting("nu_refresh_interval"),
        s.setting("nu_refresh_growth"),
    )
    # The warm-up's float32 mean runs inside the loop, and so does the compressed phase's
    # exchange of the momentum, given the optimizer's m (and, with error feedback, each
    # marked layer's residuals, which the warm-up carries over untouched).
    compressed = _loop_sync(s, compressed=True, b1=s.setting("b1"))
    loop = {"warmup": _loop_sync(s, compressed=False), "compressed": compressed}
    return _data_parallel(s, loss_fn, phases, phase_of, has_aux, model, loop)


def _build_decentralized(s: "Strategy", loss_fn, optimizer, has_aux, **model) -> TrainStep:
    return decentralized.decentralized_step(
        loss_fn, optimizer, s.mesh, has_aux=has_aux, flatten=s.flatten, **s.kwargs, **model
    )


def _build_low_precision(s: "Strategy", loss_fn, optimizer, has_aux, **model) -> TrainStep:
    return decentralized.low_precision_decentralized_step(
        loss_fn, optimizer, s.mesh, has_aux=has_aux, flatten=s.flatten, **s.kwargs, **model
    )


def _build_async(s: "Strategy", loss_fn, optimizer, has_aux, **model) -> TrainStep:
    why = "its processes train models of their own and average the params only"
    _refuse_model(model, "Strategy('async')", why)
    return asynchronous.async_model_average(
        loss_fn, optimizer, s.mesh, has_aux=has_aux, flatten=s.flatten, **s.kwargs
    )


def _build_diloco(s: "Strategy", loss_fn, optimizer, has_aux, **model) -> TrainStep:
    return diloco.diloco_step(
        loss_fn, optimizer, s.mesh, has_aux=has_aux, flatten=s.flatten, **s.kwargs, **model
    )


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """An entry of the registry.

    Attributes:
      settings: every keyword argument the algorithm takes, with its default (``REQUIRED``
        for none).
      tunable: the settings ``autotune`` may change: those that change how bytes travel,
        not what they average to, in search order (what shapes the exchanges before how
        each is cut into messages).
      build: ``build(strategy, loss_fn, optimizer, has_aux, *, model_state, rng_seed,
        state_sync) -> TrainStep``.
      takes_optimizer: whether ``train_step`` takes an optax optimizer (QAdam is one).
      check: validates the settings at construction; raises ``ValueError``.
    """

    settings: Mapping[str, Any]
    tunable: tuple[str, ...]
    build: Callable[..., TrainStep]
    takes_optimizer: bool = True
    check: Callable[["Strategy"], Any] | None = None


def _check_shard(s: "Strategy") -> None:
    where = f"Strategy({s.algorithm!r})"
    check_shard(s.setting("shard"), s.flatten, where)
    if s.setting("shard") is None:
        return
    if "pipeline" in _entry(s.algorithm).settings and s.setting("pipeline"):
        raise ValueError(
            f"{where}: shard= is not supported with pipeline=True (its programs carry the "
            "whole state); use pipeline=False"
        )
    if not s.setting("hierarchical") and s.algorithm != "gradient_allreduce":
        raise ValueError(
            f"{where}: shard= needs hierarchical=True: each device then sends its share of "
            "its node's sum between nodes"
        )


def _check_bytegrad(s: "Strategy") -> None:
    transforms.bytegrad(mesh=s.mesh, **_pick(s.kwargs, _SYNC))
    checks.boolean(s.setting("pipeline"), "pipeline", "Strategy('bytegrad')")
    _check_shard(s)


def _check_gradient_allreduce(s: "Strategy") -> None:
    transforms.gradient_allreduce(**_pick(s.kwargs, _ALLREDUCE))
    _check_shard(s)


def _check_qadam(s: "Strategy") -> None:
    qadam.qadam(mesh=s.mesh, **_pick(s.kwargs, _QADAM))
    checks.boolean(s.setting("skip_nonfinite"), "skip_nonfinite", "Strategy('qadam')")
    _check_shard(s)


# Bagua's algorithm names, in the order its documentation lists them.
REGISTRY: dict[str, Algorithm] = {
    "gradient_allreduce": Algorithm(
        settings={**_ALLREDUCE, **_STEP},
        tunable=("hierarchical",),
        build=_build_gradient_allreduce,
        check=_check_gradient_allreduce,
    ),
    "bytegrad": Algorithm(
        # pipeline: the step as several programs, the sync's codec beside its wire
        # (steps/pipelined.py); off, one program (data_parallel_step).
        settings={**_SYNC, **_STEP, "pipeline": False},
        tunable=("wire", "bucket_bytes", "hierarchical", "message_bytes"),
        build=_build_bytegrad,
        check=_check_bytegrad,
    ),
    "qadam": Algorithm(
        # skip_nonfinite: wrap QAdam in skip_nonfinite (train_step takes no optimizer to wrap).
        settings={**_QADAM, **_STEP, "skip_nonfinite": False},
        tunable=("wire", "bucket_bytes", "hierarchical", "message_bytes"),
        build=_build_qadam,
        takes_optimizer=False,
        check=_check_qadam,
    ),
    "decentralized": Algorithm(
        settings=_defaults(decentralized.decentralized_step, without=_GIVEN),
        tunable=("message_bytes",),
        build=_build_decentralized,
    ),
    "low_precision_decentralized": Algorithm(
        settings=_defaults(decentralized.low_precision_decentralized_step, without=_GIVEN),
        tunable=("message_bytes",),
        build=_build_low_precision,
    ),
    # Its interval changes how stale the models are, so nothing is tuned.
    "async": Algorithm(
        settings=_defaults(asynchronous.async_model_average, without=_GIVEN),
        tunable=(),
        build=_build_async,
    ),
    # Not Bagua's: DiLoCo's outer steps on ByteGrad's wire (steps/diloco.py). H changes
    # what the nodes average, so nothing is tuned.
    "diloco": Algorithm(
        settings=_defaults(diloco.diloco_step, without=_GIVEN),
        tunable=(),
        build=_build_diloco,
        check=lambda s: diloco.check_settings(s.mesh, s.kwargs, s.flatten),
    ),
}
# Bagua's six, each of which the examples train and the README's tables cover; "diloco", the
# registry's one algorithm that is not Bagua's, is built by name but not listed here.
ALGORITHMS = tuple(name for name in REGISTRY if name != "diloco")


def _entry(algorithm) -> Algorithm:
    if algorithm not in REGISTRY:
        raise ValueError(
            f"Strategy: unknown algorithm {algorithm!r}; use one of {', '.join(REGISTRY)}"
        )
    return REGISTRY[algorithm]


# The entry point -------------------------------------------------------------------------


def tunable_settings(algorithm: str) -> tuple[str, ...]:
    """The settings ``autotune`` may change for ``algorithm``, in search order."""
    return _entry(algorithm).tunable


class Strategy:
    """Bagua's algorithms behind one entry point: switch algorithm by changing one string.

    Args:
      algorithm: one of ``ALGORITHMS``: ``"gradient_allreduce"``, ``"bytegrad"``,
        ``"qadam"``, ``"decentralized"``, ``"low_precision_decentralized"``, ``"async"``;
        or ``"diloco"`` (``diloco_step``: the nodes exchange every H steps, docs/diloco.md).
      mesh: from ``make_mesh``; by default ``make_mesh()`` (one node per process).
      flatten: keep the params, gradient and optimizer state as one float32 vector (Bagua's
        fused optimizer; Lightning's ``BaguaStrategy(flatten=True)``); the loss function
        still gets the pytree. XLA:CPU runs an optimizer's update as one kernel per leaf,
        so many small leaves gain most (benchmarks/RESULTS.md, "Flattened optimizer").
        ByteGrad then sends the model as one bucket (one message per collective), and
        mixed-dtype params are held in their common dtype.
      **algorithm_kwargs: the algorithm's settings (``Strategy.valid_kwargs(algorithm)``
        lists them): for ``gradient_allreduce``, ``bytegrad`` and ``qadam`` those of the transform
        (``bytegrad()``, ...) and of ``data_parallel_step`` (``donate``, ``node_axis``,
        ``local_axis``); for the others, those of their step builder
        (``decentralized_step``, ``low_precision_decentralized_step``,
        ``experimental.async_model_average``, e.g. ``sync_interval_ms``). ``qadam`` is a
        whole optimizer: its ``learning_rate`` and ``warmup_steps`` (and ``b1``, ``b2``,
        ``eps``, ``weight_decay``) go here, and ``train_step`` takes no optimizer.

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
        entry = _entry(algorithm)
        checks.boolean(flatten, "flatten", "Strategy")
        valid = Strategy.valid_kwargs(algorithm)
        unknown = sorted(set(algorithm_kwargs) - set(valid))
        if "shard" in unknown:
            supported = [name for name, e in REGISTRY.items() if "shard" in e.settings]
            raise ValueError(
                f"Strategy({algorithm!r}): shard= is supported by {', '.join(supported[:-1])} "
                f"and {supported[-1]}; {algorithm} keeps its own copy of the model on every "
                "device"
            )
        if unknown:
            raise ValueError(
                f"Strategy({algorithm!r}): unknown keyword argument(s) {', '.join(unknown)}; "
                f"{algorithm} takes {', '.join(valid)}"
            )
        missing = [
            name
            for name, default in entry.settings.items()
            if default is REQUIRED and name not in algorithm_kwargs
        ]
        if missing:
            raise ValueError(
                f"Strategy({algorithm!r}): missing keyword argument(s) {', '.join(missing)}; "
                f"pass them, e.g. Strategy({algorithm!r}, {missing[0]}=...)"
            )
        self.algorithm = algorithm
        self.mesh = mesh_lib.make_mesh() if mesh is None else mesh
        self.kwargs = dict(algorithm_kwargs)
        self.flatten = flatten
        if entry.check is not None:
            entry.check(self)  # bad values fail now, not at the first step

    @staticmethod
    def valid_kwargs(algorithm: str) -> tuple[str, ...]:
        """The keyword arguments ``Strategy(algorithm, ...)`` accepts.

        Args:
          algorithm: one of ``ALGORITHMS``.

        Returns:
          The names, sorted.

        Raises:
          ValueError: for an unknown algorithm.

        Examples:
          >>> import jax_bytegrad
          >>> "sync_interval_ms" in jax_bytegrad.Strategy.valid_kwargs("async")
          True
        """
        return tuple(sorted(_entry(algorithm).settings))

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
        """The value the algorithm runs with for keyword ``name``: the one given, else its
        default.

        Raises:
          ValueError: for a name the algorithm does not take.

        Examples:
          >>> import jax_bytegrad
          >>> s = jax_bytegrad.Strategy("bytegrad", mesh=jax_bytegrad.make_mesh(1, 1))
          >>> s.setting("bits"), s.setting("message_bytes")
          (8, 262144)
        """
        settings = _entry(self.algorithm).settings
        if name not in settings:
            raise ValueError(
                f"Strategy({self.algorithm!r}): no setting {name!r}; "
                f"{self.algorithm} takes {', '.join(Strategy.valid_kwargs(self.algorithm))}"
            )
        return self.kwargs.get(name, settings[name])

    def train_step(
        self,
        loss_fn: Callable[..., Any],
        optimizer: optax.GradientTransformation | None = None,
        *,
        has_aux: bool = False,
        model_state: Any = None,
        rng_seed: int | None = None,
        state_sync: StateSync = "mean",
    ) -> TrainStep:
        """Builds the train step of this strategy's algorithm.

        Args:
          loss_fn: ``loss_fn(params, batch) -> loss`` (or ``(loss, aux)`` with ``has_aux``),
            computed on one device's slice of the batch.
          optimizer: the optax optimizer (``optax.adam(1e-3)``); the algorithm adds its own
            communication. None for ``qadam``, which is the optimizer itself.
          has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
          model_state: the model's state that is not trained (BatchNorm statistics,
            counters), to start from. The loss function is then called ``loss_fn(params,
            batch, model_state=...)`` and returns ``(loss, new_model_state)`` (or ``((loss,
            aux), new_model_state)``); ``state.model_state`` carries it, replicated.
          rng_seed: the loss function also gets ``key=``, a PRNG key that differs per device
            and per step, derived from ``jax.random.key(rng_seed)`` (``state.rng``) and the
            step count, so a restart from a checkpoint replays it (``step.device_key(state,
            device)`` computes it outside the step).
          state_sync: how the devices' new model states become one: ``"mean"`` over the
            mesh (cross-replica BatchNorm; integer leaves from device 0) or ``"first"``
            (device 0's, as DDP's ``broadcast_buffers``). Without ``model_state`` and
            ``rng_seed`` the step is as before: nothing is added to its traffic.

        Returns:
          A ``TrainStep``: ``state = step.init(params)``, ``state, metrics = step(state,
          batch)``, ``step.params(state)``, ``step.close()``. ``metrics["loss"]`` (and the
          float leaves of ``metrics["aux"]``) are means over every device of the mesh for all
          algorithms but ``async``, where they are means over this process's devices (its
          processes train on their own). For the decentralized pair each device's loss is
          taken at its own weights before the exchange.

        Raises:
          ValueError: for an optimizer given to ``qadam`` or missing for the others,
            (decentralized and async) a bad algorithm argument, a bad ``model_state``,
            ``rng_seed`` or ``state_sync``, or either of the first two for ``async`` or
            ``bytegrad`` with ``pipeline=True``, which do not carry them.
        """
        name = self.algorithm
        entry = _entry(name)
        if not entry.takes_optimizer and optimizer is not None:
            raise ValueError(
                f"Strategy({name!r}): {name} is the optimizer itself (Adam with an 8-bit "
                "momentum exchange), so train_step takes optimizer=None; pass its settings to "
                f"the strategy: Strategy({name!r}, learning_rate=1e-3, warmup_steps=100, ...)"
            )
        accumulation = None
        if isinstance(optimizer, optax.MultiSteps):
            if entry.build not in (_build_gradient_allreduce, _build_bytegrad):
                raise ValueError(
                    f"Strategy({name!r}): gradient accumulation (optax.MultiSteps) is supported "
                    "by gradient_allreduce and bytegrad (and qadam through "
                    "data_parallel_step(loss_fn, optax.MultiSteps(qadam(...), k), mesh))"
                )
            optimizer, accumulation = Accumulation.of(optimizer, f"Strategy({name!r})")
        if entry.takes_optimizer and not isinstance(optimizer, optax.GradientTransformation):
            raise ValueError(
                f"Strategy({name!r}): optimizer must be an optax.GradientTransformation such "
                f"as optax.adam(1e-3) (or an optax.MultiSteps of one), got {optimizer!r}"
            )
        model = dict(model_state=model_state, rng_seed=rng_seed, state_sync=state_sync)
        if accumulation is not None:
            model["accumulation"] = accumulation
        return entry.build(self, loss_fn, optimizer, has_aux, **model)
