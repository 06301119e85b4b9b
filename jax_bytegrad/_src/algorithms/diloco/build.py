"""``Strategy("diloco")``: its settings, build and check, registered at import. Not one of
Bagua's: DiLoCo's outer steps on ByteGrad's wire (``step.py``).

References:
  Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023.
"""

from jax_bytegrad._src.algorithms import registry
from jax_bytegrad._src.algorithms.diloco import step
from jax_bytegrad._src.algorithms.registry import Algorithm, Settings
from jax_bytegrad._src.steps.base import TrainStep


def _build_diloco(s: Settings, loss_fn, optimizer, has_aux, **model) -> TrainStep:
    return step.diloco_step(
        loss_fn, optimizer, s.mesh, has_aux=has_aux, flatten=s.flatten, **s.kwargs, **model
    )


registry.register(
    Algorithm(
        name="diloco",
        settings=registry.defaults(step.diloco_step),
        # H changes what the nodes average, so nothing is tuned.
        tunable=(),
        build=_build_diloco,
        check=lambda s: step.check_settings(s.mesh, s.kwargs, s.flatten),
        bagua=False,
    )
)
