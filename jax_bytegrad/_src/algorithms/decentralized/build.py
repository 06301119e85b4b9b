"""``Strategy("decentralized")`` and ``Strategy("low_precision_decentralized")``: their
settings and builds, registered at import.

References:
  Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
"""

from jax_bytegrad._src.algorithms import registry
from jax_bytegrad._src.algorithms.decentralized import step

registry.register_factory("decentralized", step.decentralized_step, tunable=("message_bytes",))
registry.register_factory(
    "low_precision_decentralized",
    step.low_precision_decentralized_step,
    tunable=("message_bytes",),
)
