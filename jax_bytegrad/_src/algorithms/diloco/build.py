"""``Strategy("diloco")``: its settings, build and check, registered at import. Not one of
Bagua's: DiLoCo's outer steps on ByteGrad's wire (``step.py``).

References:
  Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models", 2023.
"""

from jax_bytegrad._src.algorithms import registry
from jax_bytegrad._src.algorithms.diloco import step

registry.register_factory(
    "diloco",
    step.diloco_step,
    # H changes what the nodes average, so nothing is tuned.
    tunable=(),
    check=lambda s: step.check_settings(s.mesh, s.kwargs, s.flatten),
    bagua=False,
)
