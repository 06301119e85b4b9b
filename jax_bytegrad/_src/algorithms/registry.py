"""The registry of algorithms ``Strategy`` builds by name: each algorithm's package registers
its entries here when it is imported (``algorithms/__init__.py`` imports them all, in Bagua's
documented order), and ``strategy.py`` looks them up.

This module imports no algorithm: an algorithm depends on it, never the other way round.

References:
  Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
"""

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from jax.sharding import Mesh

from jax_bytegrad._src.steps.base import TrainStep
from jax_bytegrad._src.steps.model_state import ModelState

# A setting without a default: the strategy must be given it.
REQUIRED = object()

# What train_step passes itself, or the strategy decides: never a setting.
GIVEN = ("loss_fn", "optimizer", "mesh", "has_aux", "flatten", "phase", "phase_of")
GIVEN += ("model_state", "rng_seed", "state_sync")


class Settings(Protocol):
    """What a build or check reads of a ``Strategy``: its algorithm's name, mesh, the keyword
    arguments it was given, and each setting's value (given, else its default)."""

    algorithm: str
    mesh: Mesh
    kwargs: dict[str, Any]
    flatten: bool

    def setting(self, name: str) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """An entry of the registry.

    Attributes:
      name: the name ``Strategy`` takes (Bagua's, where it is one of Bagua's).
      settings: every keyword argument the algorithm takes, with its default (``REQUIRED``
        for none).
      tunable: the settings ``autotune`` may change: those that change how bytes travel,
        not what they average to, in search order (what shapes the exchanges before how
        each is cut into messages).
      build: ``build(strategy, loss_fn, optimizer, has_aux, *, model_state, rng_seed,
        state_sync[, accumulation]) -> TrainStep``.
      takes_optimizer: whether ``train_step`` takes an optax optimizer (QAdam is one).
      check: validates the settings at construction; raises ``ValueError``.
      accumulates: whether ``train_step`` takes an ``optax.MultiSteps`` (the build then gets
        ``accumulation=``).
      bagua: whether it is one of Bagua's algorithms (listed in ``ALGORITHMS``).
    """

    name: str
    settings: Mapping[str, Any]
    tunable: tuple[str, ...]
    build: Callable[..., TrainStep]
    takes_optimizer: bool = True
    check: Callable[[Settings], Any] | None = None
    accumulates: bool = False
    bagua: bool = True


# In the order of registration, which algorithms/__init__.py fixes: Bagua's documented order.
REGISTRY: dict[str, Algorithm] = {}


def register(entry: Algorithm) -> Algorithm:
    """Adds ``entry`` to the registry; raises ``ValueError`` for a name already there."""
    if entry.name in REGISTRY:
        raise ValueError(f"algorithm {entry.name!r} is already registered; pick another name")
    REGISTRY[entry.name] = entry
    return entry


def lookup(name: str) -> Algorithm:
    """The entry registered as ``name``; raises ``ValueError`` listing the names otherwise."""
    if name not in REGISTRY:
        raise ValueError(f"Strategy: unknown algorithm {name!r}; use one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def defaults(builder, *, only=None, without=GIVEN) -> dict[str, Any]:
    """The keyword arguments of ``builder`` (those in ``only``, if given, but those in
    ``without``), each with its default, ``REQUIRED`` where it has none: read from the
    signature, so the registry never restates a default."""
    out = {}
    for p in inspect.signature(builder).parameters.values():
        if (only is None or p.name in only) and p.name not in without:
            out[p.name] = REQUIRED if p.default is inspect.Parameter.empty else p.default
    return out


def pick(kwargs: Mapping[str, Any], names) -> dict[str, Any]:
    """The items of ``kwargs`` named in ``names``."""
    return {k: v for k, v in kwargs.items() if k in names}


def refuse_model(model, where: str, why: str) -> None:
    """Raises ``ValueError`` if ``model`` (``train_step``'s model arguments) asks for a model
    state or a key, which the step at ``where`` does not carry (``why``)."""
    ModelState.of(model["model_state"], model["rng_seed"], model["state_sync"], where).refuse(
        where, why
    )


def register_factory(name: str, factory, *, tunable, refuse: str | None = None, **entry):
    """Registers the algorithm ``name`` whose step one factory makes, ``factory(loss_fn,
    optimizer, mesh, *, has_aux, flatten, **settings, **model)``: its settings are the
    factory's keywords (``defaults``), and its build calls it with the strategy's and
    ``train_step``'s model arguments, or with ``refuse`` (why the step carries no model state
    or key) refuses those. ``entry``: the rest of its ``Algorithm``."""

    def build(s: Settings, loss_fn, optimizer, has_aux, **model) -> TrainStep:
        if refuse is not None:
            refuse_model(model, f"Strategy({s.algorithm!r})", refuse)
            model = {}
        kwargs = dict(has_aux=has_aux, flatten=s.flatten, **s.kwargs, **model)
        return factory(loss_fn, optimizer, s.mesh, **kwargs)

    settings = defaults(factory)
    return register(Algorithm(name, settings, tunable, build, **entry))
