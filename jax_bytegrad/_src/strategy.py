"""One entry point for the six algorithms, by Bagua's names: a registry of algorithms.

Follows Bagua's strategy for PyTorch Lightning (``BaguaStrategy(algorithm=...,
**algorithm_kwargs)``; Gan et al., "Bagua: Scaling up Distributed Learning with System
Relaxations", VLDB 2022): one object, one string to switch algorithm, and the remaining
keyword arguments handed to the algorithm. Each algorithm's package (``algorithms/``)
registers its entries (``algorithms/registry.py``): the settings the algorithm takes (with
their defaults), those ``autotune`` may change, and how to build its ``TrainStep``; this
module looks them up::

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

from collections.abc import Callable
from typing import Any

import optax
from jax.sharding import Mesh

from jax_bytegrad._src import algorithms as algorithms  # registers every algorithm
from jax_bytegrad._src import checks
from jax_bytegrad._src import mesh as mesh_lib
from jax_bytegrad._src.algorithms.registry import REGISTRY as REGISTRY
from jax_bytegrad._src.algorithms.registry import REQUIRED as REQUIRED
from jax_bytegrad._src.algorithms.registry import Algorithm as Algorithm
from jax_bytegrad._src.algorithms.registry import lookup as _entry
from jax_bytegrad._src.steps.accumulation import Accumulation
from jax_bytegrad._src.steps.base import TrainStep
from jax_bytegrad._src.steps.model_state import StateSync

# Bagua's six, each of which the examples train and the README's tables cover; "diloco", the
# registry's one algorithm that is not Bagua's, is built by name but not listed here.
ALGORITHMS = tuple(name for name, entry in REGISTRY.items() if entry.bagua)


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
        if mesh is not None and {"node_axis", "local_axis"} <= set(entry.settings):
            # A mesh of the user's own whose axes cross a TPU slice's links the wrong way.
            mesh_lib.warn_if_mesh_crosses_slices(
                self.mesh,
                node_axis=self.setting("node_axis"),
                local_axis=self.setting("local_axis"),
                where=f"Strategy({algorithm!r})",
            )

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
                + (", and every_k_schedule=k to accumulate micro-steps as optax.MultiSteps does"
                   if isinstance(optimizer, optax.MultiSteps) else "")
            )  # fmt: skip
        accumulation = None
        if isinstance(optimizer, optax.MultiSteps):
            if not entry.accumulates:
                supported = [n for n, e in REGISTRY.items() if e.accumulates]
                raise ValueError(
                    f"Strategy({name!r}): gradient accumulation (optax.MultiSteps) is supported "
                    f"by {' and '.join(supported)} (and by Strategy('qadam', "
                    "every_k_schedule=k))"
                )
            optimizer, accumulation = Accumulation.of(optimizer, f"Strategy({name!r})")
        if entry.takes_optimizer:
            example = "optax.adam(1e-3) (or an optax.MultiSteps of one)"
            checks.transformation(optimizer, "optimizer", f"Strategy({name!r})", example)
        model = dict(model_state=model_state, rng_seed=rng_seed, state_sync=state_sync)
        if accumulation is not None:
            model["accumulation"] = accumulation
        return entry.build(self, loss_fn, optimizer, has_aux, **model)
