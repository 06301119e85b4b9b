"""Which program a data-parallel step runs: its phases.

A step has one optimizer per phase (one, ``"step"``, unless it was given ``{name: tx}`` and
``phase_of``: QAdam's warm-up and compressed phases), each its own compiled program, picked on
the host from the steps taken. A step that accumulates (``accumulation.py``) adds the phase
``ACCUMULATE`` for its micro-steps before the k-th; where those micro-steps exchange between
nodes (``shard="full"``, whose accumulator holds each device's blocks of the mean), their
program also needs the sync of the step they belong to, and its phase is
``(ACCUMULATE, that step's phase)``.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import optax

from jax_bytegrad._src.steps.accumulation import Accumulation

# The phase of the micro-steps that only accumulate.
ACCUMULATE = "accumulate"


def accumulates(phase) -> bool:
    """Whether a program's phase is a micro-step that only accumulates: ``ACCUMULATE``, or
    ``(ACCUMULATE, phase it exchanges on)``."""
    return phase == ACCUMULATE or (isinstance(phase, tuple) and phase[0] == ACCUMULATE)


def gradient_phase(phase):
    """The optimizer phase whose sync a program's backward pass exchanges on (None: none)."""
    if isinstance(phase, tuple):
        return phase[1]
    return None if phase == ACCUMULATE else phase


def optimizers_of(optimizer, phase_of, where: str) -> tuple[dict, Callable[[int], str]]:
    """``{phase: transformation}`` and ``phase_of`` from ``data_parallel_step``'s
    ``optimizer`` and ``phase_of``; raises a ``ValueError`` for anything else."""
    if isinstance(optimizer, optax.GradientTransformation):
        if phase_of is not None:
            raise ValueError(f"{where}: phase_of needs one optimizer per phase, {{name: tx}}")
        return {"step": optimizer}, lambda _: "step"
    optimizers = dict(optimizer) if isinstance(optimizer, Mapping) else {}
    bad = [k for k, v in optimizers.items() if not isinstance(v, optax.GradientTransformation)]
    if not optimizers or bad or phase_of is None:
        raise ValueError(
            f"{where}: optimizer must be an optax.GradientTransformation, or a non-empty "
            "{phase name: transformation} mapping with phase_of=...; got "
            f"{type(optimizer).__name__}"
        )
    return optimizers, phase_of


@dataclasses.dataclass(frozen=True)
class Phases:
    """A step's phases.

    Attributes:
      optimizers: ``{phase: transformation}``.
      phase_of: ``phase_of(gradient steps taken) -> phase``.
      accumulation: how the step accumulates micro-steps; None if it does not.
      micro_exchange: whether its accumulating micro-steps exchange between nodes.
      algorithm: the step's name, for errors.
    """

    optimizers: Mapping[str, Any]
    phase_of: Callable[[int], str]
    accumulation: Accumulation | None
    micro_exchange: bool
    algorithm: str

    def __post_init__(self):
        if self.accumulation is not None and ACCUMULATE in self.optimizers:
            raise ValueError(f"{self.algorithm}: a phase may not be named {ACCUMULATE!r}")

    @property
    def names(self) -> tuple[str, ...]:
        """Every phase a step may run, as ``phase_counts`` counts them."""
        names = tuple(self.optimizers)
        return names if self.accumulation is None else (ACCUMULATE, *names)

    def of(self, steps_taken: int) -> tuple[str, Any]:
        """``(name, program phase)`` of the step after ``steps_taken``."""
        taken, micro, k = steps_taken, 0, 1
        if self.accumulation is not None:
            taken, micro, k = self.accumulation.position(steps_taken)
        name = self.phase_of(taken)
        if name not in self.optimizers:
            raise ValueError(
                f"{self.algorithm}: phase_of({taken}) gave {name!r}, which is not one of "
                f"the optimizers' phases {tuple(self.optimizers)}"
            )
        if micro < k - 1:
            # A micro-step that exchanges crosses on the sync of the step it belongs to.
            return ACCUMULATE, (ACCUMULATE, name) if self.micro_exchange else ACCUMULATE
        return name, name

    def program(self, name: str | None) -> Any:
        """The program phase of a phase ``name`` a user asks for (None: the first
        optimizer's); an exchanging micro-step's runs on the first optimizer's sync."""
        first = next(iter(self.optimizers))
        if name == ACCUMULATE and self.micro_exchange:
            return ACCUMULATE, first
        return name if name is not None else first
