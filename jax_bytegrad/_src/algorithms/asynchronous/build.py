"""``Strategy("async")``: its settings and build, registered at import.

References:
  Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
"""

from jax_bytegrad._src.algorithms import data_parallel, registry
from jax_bytegrad._src.algorithms.asynchronous import step
from jax_bytegrad._src.algorithms.registry import Algorithm, Settings
from jax_bytegrad._src.steps.base import TrainStep


def _build_async(s: Settings, loss_fn, optimizer, has_aux, **model) -> TrainStep:
    why = "its processes train models of their own and average the params only"
    data_parallel.refuse_model(model, "Strategy('async')", why)
    return step.async_model_average(
        loss_fn, optimizer, s.mesh, has_aux=has_aux, flatten=s.flatten, **s.kwargs
    )


registry.register(
    Algorithm(
        name="async",
        settings=registry.defaults(step.async_model_average),
        # Its interval changes how stale the models are, so nothing is tuned.
        tunable=(),
        build=_build_async,
    )
)
