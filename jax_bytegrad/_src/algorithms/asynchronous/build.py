"""``Strategy("async")``: its settings and build, registered at import.

References:
  Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
"""

from jax_bytegrad._src.algorithms import registry
from jax_bytegrad._src.algorithms.asynchronous import step

registry.register_factory(
    "async",
    step.async_model_average,
    # Its interval changes how stale the models are, so nothing is tuned.
    tunable=(),
    refuse="its processes train models of their own and average the params only",
)
