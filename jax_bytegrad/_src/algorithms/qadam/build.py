"""``Strategy("qadam")``: its settings, build and check, registered at import.

References:
  Tang et al., "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
  Convergence Speed", ICML 2021; Gan et al., "Bagua", VLDB 2022.
"""

from jax_bytegrad._src import checks, guard
from jax_bytegrad._src.algorithms import data_parallel, registry
from jax_bytegrad._src.algorithms.qadam import schedule, transform
from jax_bytegrad._src.algorithms.registry import Algorithm, Settings, pick
from jax_bytegrad._src.steps.accumulation import Accumulation
from jax_bytegrad._src.steps.base import TrainStep

QADAM = registry.defaults(transform.qadam)


def _build_qadam(s: Settings, loss_fn, optimizer, has_aux, **model) -> TrainStep:
    del optimizer  # QAdam is the optimizer
    every_k = s.setting("every_k_schedule")
    if every_k is not None:
        model["accumulation"] = Accumulation.every(every_k, "Strategy('qadam')")
    kwargs = pick(s.kwargs, QADAM)
    phases = {
        phase: transform.qadam(mesh=s.mesh, phase=phase, **kwargs)
        for phase in ("warmup", "compressed")
    }
    if s.setting("skip_nonfinite"):
        # The update is the same on every replica, so every replica skips the same steps.
        phases = {phase: guard.skip_nonfinite(tx) for phase, tx in phases.items()}
    phase_of = schedule.phase_schedule(
        s.setting("warmup_steps"),
        s.setting("nu_refresh_interval"),
        s.setting("nu_refresh_growth"),
    )
    # The warm-up's float32 mean runs inside the loop, and so does the compressed phase's
    # exchange of the momentum, given the optimizer's m (and, with error feedback, each
    # marked layer's residuals, which the warm-up carries over untouched).
    compressed = data_parallel.loop_sync(s, compressed=True, b1=s.setting("b1"))
    loop = {"warmup": data_parallel.loop_sync(s, compressed=False), "compressed": compressed}
    return data_parallel.build_step(s, loss_fn, phases, phase_of, has_aux, model, loop)


def _check_qadam(s: Settings) -> None:
    transform.qadam(mesh=s.mesh, **pick(s.kwargs, QADAM))
    checks.boolean(s.setting("skip_nonfinite"), "skip_nonfinite", "Strategy('qadam')")
    if s.setting("every_k_schedule") is not None:
        Accumulation.every(s.setting("every_k_schedule"), "Strategy('qadam')")
    data_parallel.check_sharded(s)


registry.register(
    Algorithm(
        name="qadam",
        # skip_nonfinite: wrap QAdam in skip_nonfinite; every_k_schedule: accumulate k
        # micro-steps, as optax.MultiSteps would (train_step takes no optimizer to wrap).
        settings={
            **QADAM,
            **data_parallel.STEP,
            "skip_nonfinite": False,
            "every_k_schedule": None,
        },
        tunable=("wire", "bucket_bytes", "hierarchical", "message_bytes"),
        build=_build_qadam,
        takes_optimizer=False,
        check=_check_qadam,
    )
)
