"""``Strategy("decentralized")`` and ``Strategy("low_precision_decentralized")``: their
settings and builds, registered at import.

References:
  Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
"""

from jax_bytegrad._src.algorithms import registry
from jax_bytegrad._src.algorithms.decentralized import step
from jax_bytegrad._src.algorithms.registry import Algorithm, Settings
from jax_bytegrad._src.steps.base import TrainStep


def _build_decentralized(s: Settings, loss_fn, optimizer, has_aux, **model) -> TrainStep:
    return step.decentralized_step(
        loss_fn, optimizer, s.mesh, has_aux=has_aux, flatten=s.flatten, **s.kwargs, **model
    )


def _build_low_precision(s: Settings, loss_fn, optimizer, has_aux, **model) -> TrainStep:
    return step.low_precision_decentralized_step(
        loss_fn, optimizer, s.mesh, has_aux=has_aux, flatten=s.flatten, **s.kwargs, **model
    )


registry.register(
    Algorithm(
        name="decentralized",
        settings=registry.defaults(step.decentralized_step),
        tunable=("message_bytes",),
        build=_build_decentralized,
    )
)
registry.register(
    Algorithm(
        name="low_precision_decentralized",
        settings=registry.defaults(step.low_precision_decentralized_step),
        tunable=("message_bytes",),
        build=_build_low_precision,
    )
)
