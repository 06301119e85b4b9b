"""What the data-parallel algorithms' builds share (``gradient_allreduce``, ``bytegrad``,
``qadam``): the step's own settings, its construction from a strategy, the sync a sharded
step runs inside its loop, and the checks of ``shard=``."""

import dataclasses

import optax

from jax_bytegrad._src.algorithms import registry
from jax_bytegrad._src.algorithms.registry import Settings
from jax_bytegrad._src.sharding.placement import check_shard
from jax_bytegrad._src.steps.base import TrainStep
from jax_bytegrad._src.steps.data_parallel import DataParallelStep, data_parallel_step
from jax_bytegrad._src.steps.loop_exchange import LoopSync
from jax_bytegrad._src.steps.model_state import ModelState
from jax_bytegrad._src.sync.config import SyncConfig

# The data-parallel step's own settings, besides the transform's.
STEP = registry.defaults(data_parallel_step, only=("donate", "node_axis", "local_axis", "shard"))
SYNC_CONFIG = tuple(f.name for f in dataclasses.fields(SyncConfig))


def loop_sync(s: Settings, *, compressed: bool, reduce_dtype=None, b1=None) -> LoopSync | None:
    """What a ``shard="params"`` step of ``s`` runs on a layer marked ``exchange_in_loop``
    (and a ``shard="full"`` step on every layer's gradient): the sync of its optimizer, with
    the same settings (``b1``: of the momentum, as ``LoopSync``); None for another
    ``shard=``."""
    if s.setting("shard") not in ("params", "full"):
        return None
    names = SYNC_CONFIG if compressed else ("node_axis", "local_axis")
    config = SyncConfig(**registry.pick(s.kwargs, names), where=s.algorithm)
    average = s.setting("average") if "average" in registry.lookup(s.algorithm).settings else True
    return LoopSync(config, compressed, average, reduce_dtype, b1)


def build_step(s: Settings, loss_fn, optimizers, phase_of, has_aux, model,
               loop_syncs=None) -> TrainStep:  # fmt: skip
    """The data-parallel step of ``s``, named after its algorithm."""
    model = dict(model)
    accumulation = model.pop("accumulation", None)
    step = {k: s.setting(k) for k in STEP}
    return DataParallelStep(
        s.algorithm,
        loss_fn,
        optimizers,
        phase_of,
        s.mesh,
        has_aux=has_aux,
        donate=step["donate"],
        axes=(step["node_axis"], step["local_axis"]),
        flatten=s.flatten,
        model=ModelState.of(*model.values(), f"Strategy({s.algorithm!r})"),
        shard=step["shard"],
        accumulation=accumulation,
        loop_syncs=loop_syncs,
    )


def build_chained(s: Settings, loss_fn, sync, optimizer, has_aux, model, loop) -> TrainStep:
    """The data-parallel step of ``s`` whose one optimizer is ``sync`` chained before
    ``optimizer`` (``loop``: its ``loop_sync``)."""
    optimizers = {"step": optax.chain(sync, optimizer)}
    return build_step(s, loss_fn, optimizers, lambda _: "step", has_aux, model, {"step": loop})


def check_sharded(s: Settings) -> None:
    """Validates ``shard=`` (and what it needs) for ``s``; raises ``ValueError``."""
    where = f"Strategy({s.algorithm!r})"
    check_shard(s.setting("shard"), s.flatten, where)
    if s.setting("shard") is None:
        return
    if "pipeline" in registry.lookup(s.algorithm).settings and s.setting("pipeline"):
        raise ValueError(
            f"{where}: shard= is not supported with pipeline=True (its programs carry the "
            "whole state); use pipeline=False"
        )
    # gradient_allreduce's default is flat (hierarchical=False), and a sharded step runs it
    # hierarchically; only a flat sync asked for in so many words is refused.
    flat = not s.setting("hierarchical")
    if flat and (s.algorithm != "gradient_allreduce" or "hierarchical" in s.kwargs):
        raise ValueError(
            f"{where}: shard= needs hierarchical=True: each device then sends its share of "
            "its node's sum between nodes (a sharded gradient_allreduce runs so by default)"
        )
