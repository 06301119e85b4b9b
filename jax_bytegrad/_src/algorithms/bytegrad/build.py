"""``Strategy("gradient_allreduce")`` and ``Strategy("bytegrad")``: their settings, builds and
checks, registered at import. The transforms are ``transforms.gradient_allreduce`` and
``transforms.bytegrad``; ``pipeline=True`` builds the pipelined step (``pipelined.py``).

References:
  Gan et al., "Bagua: Scaling up Distributed Learning with System Relaxations", VLDB 2022.
"""

from jax_bytegrad._src import checks, transforms
from jax_bytegrad._src.algorithms import data_parallel, registry
from jax_bytegrad._src.algorithms.bytegrad import pipelined
from jax_bytegrad._src.algorithms.registry import Algorithm, Settings, pick
from jax_bytegrad._src.steps.base import TrainStep
from jax_bytegrad._src.sync import collectives
from jax_bytegrad._src.sync.config import SyncConfig

SYNC = registry.defaults(transforms.bytegrad)
ALLREDUCE = registry.defaults(transforms.gradient_allreduce)


def _build_gradient_allreduce(s: Settings, loss_fn, optimizer, has_aux, **model) -> TrainStep:
    sync = transforms.gradient_allreduce(**pick(s.kwargs, ALLREDUCE))
    reduce_dtype = collectives.reduce_dtype_of(s.setting("reduce_dtype"), s.algorithm)
    loop = data_parallel.loop_sync(s, compressed=False, reduce_dtype=reduce_dtype)
    return data_parallel.build_chained(s, loss_fn, sync, optimizer, has_aux, model, loop)


def _build_bytegrad(s: Settings, loss_fn, optimizer, has_aux, **model) -> TrainStep:
    if s.setting("pipeline"):
        where = "Strategy('bytegrad', pipeline=True)"
        if "accumulation" in model:
            raise ValueError(f"{where} does not accumulate micro-steps; use pipeline=False")
        why = "its programs carry the params and optimizer state only"
        registry.refuse_model(model, where, why)
        return pipelined.PipelinedStep(
            "bytegrad",
            loss_fn,
            optimizer,
            s.mesh,
            sync=SyncConfig(**pick(s.kwargs, data_parallel.SYNC_CONFIG), where="bytegrad"),
            average=s.setting("average"),
            seed=s.setting("seed"),
            has_aux=has_aux,
            donate=s.setting("donate"),
            flatten=s.flatten,
        )
    sync = transforms.bytegrad(mesh=s.mesh, **pick(s.kwargs, SYNC))
    loop = data_parallel.loop_sync(s, compressed=True)
    return data_parallel.build_chained(s, loss_fn, sync, optimizer, has_aux, model, loop)


def _check_bytegrad(s: Settings) -> None:
    transforms.bytegrad(mesh=s.mesh, **pick(s.kwargs, SYNC))
    checks.boolean(s.setting("pipeline"), "pipeline", "Strategy('bytegrad')")
    data_parallel.check_sharded(s)


def _check_gradient_allreduce(s: Settings) -> None:
    transforms.gradient_allreduce(**pick(s.kwargs, ALLREDUCE))
    data_parallel.check_sharded(s)


registry.register(
    Algorithm(
        name="gradient_allreduce",
        settings={**ALLREDUCE, **data_parallel.STEP},
        tunable=("hierarchical",),
        build=_build_gradient_allreduce,
        check=_check_gradient_allreduce,
        accumulates=True,
    )
)
registry.register(
    Algorithm(
        name="bytegrad",
        # pipeline: the step as several programs, the sync's codec beside its wire
        # (pipelined.py); off, one program (data_parallel_step).
        settings={**SYNC, **data_parallel.STEP, "pipeline": False},
        tunable=("wire", "bucket_bytes", "hierarchical", "message_bytes"),
        build=_build_bytegrad,
        check=_check_bytegrad,
        accumulates=True,
    )
)
