"""What the examples train, and the registry of algorithms: each one's Strategy arguments.

An algorithm is one entry of ``ALGORITHMS``, keyed by Bagua's name (``jax_bytegrad.ALGORITHMS``):
the keyword arguments ``jax_bytegrad.Strategy(name, ...)`` gets for a ``Config``, whether it
takes the run's optimizer, and how many processes it needs. Everything else is the same for
every algorithm.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import optax

import jax_bytegrad

# Simulated layout on CPU: the smallest one where both the "node" and the "local" hop exist.
CPU_NODES, CPU_DEVICES_PER_NODE = 2, 4

MODEL_DEFAULTS = {
    "cnn": {
        "dataset": "digits",
        "steps": 300,
        "batch_size": 128,
        "learning_rate": 1e-3,
    },
    "transformer": {
        "dataset": "pysource",
        "steps": 300,
        "batch_size": 64,
        "learning_rate": 2e-3,
    },
}

# What the inter-node traffic of every algorithm is compared with.
BASELINE = "gradient_allreduce"

# Measured with Bagua's frozen second moment (second_moment="frozen"): on the CNN (with eps
# 1e-5), 8 warm-up steps left it unsettled (test accuracy 35-65%, and 13% with 6); with eps
# 1e-4, 10 warm-up steps reached 93-97% over 4 seeds and both wires (benchmarks/RESULTS.md,
# "QAdam's eps"). The default rule since then keeps updating v after warm-up (from the gradient
# recovered from the decoded momenta, at 8 bits) and did not diverge on short runs ("QAdam's
# second moment after warm-up"); the floor stays, as a margin.
QADAM_MIN_WARMUP = 10


@dataclasses.dataclass(frozen=True)
class Config:
    """What to train, how, and on which mesh.

    Attributes:
      algorithm: a key of ``ALGORITHMS``, or ``"diloco"`` (``EXTRA_ALGORITHMS``).
      model: ``"cnn"`` (digits) or ``"transformer"`` (character LM on Python source).
      steps: training steps; None for the model's default.
      batch_size: global batch, a multiple of the device count; None for the default.
      learning_rate: Adam's learning rate; None for the model's default.
      seq_len: characters per transformer example.
      nodes: mesh rows ("node" axis); None: processes, or 2 simulated nodes on CPU.
      devices_per_node: mesh columns ("local" axis); None: devices per process, or 4 on CPU.
      qadam_warmup_fraction: share of the steps QAdam runs as float32 Adam.
      qadam_eps: QAdam's eps; None for QAdam's own default (Adam's 1e-8).
      async_interval_ms: milliseconds between async's background averaging rounds.
      diloco_inner_steps: DiLoCo's H, the inner steps between two exchanges between nodes.
      seed: seeds the parameters and the batches.
      progress: draw a progress bar (process 0 only).
      checkpoint_dir: save the training state under ``<dir>/<algorithm>`` every
        ``checkpoint_every`` steps, and resume from the newest checkpoint there (with
        ``python -m jax_bytegrad.launch --max-restarts N``, a run survives a dead worker).
      checkpoint_every: steps between checkpoints.
      cache: transformer only: train on the functions of Python's standard library (variable
        lengths, cut at ``seq_len``), tokenized once through ``jax_bytegrad.data``'s cache:
        ``"none"``, ``"embedded"`` (SQLite) or ``"redis"``; None: fixed-length windows.
      load_balance: with ``cache``: Bagua's load-balanced sampler (one replica per row, so a
        step's rows have similar lengths and pad little); otherwise a random shard.
      shard: split the state within each node (``Strategy(..., shard=...)``):
        ``"optimizer"`` (each device keeps 1/L of the optimizer state) or ``"params"`` (of the
        parameters too); None keeps every device's copy whole. gradient_allreduce, bytegrad,
        qadam and diloco only.
      autotune: time the algorithm's step under its system settings first
        (``jax_bytegrad.autotune``) and train with the fastest; cached in ``out_dir``.
      out_dir: where tables, plots and the autotune cache are written.
    """

    algorithm: str = "bytegrad"
    model: str = "cnn"
    steps: int | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
    seq_len: int = 64
    nodes: int | None = None
    devices_per_node: int | None = None
    qadam_warmup_fraction: float = 0.2
    qadam_eps: float | None = None
    async_interval_ms: int = 200
    diloco_inner_steps: int = 10
    seed: int = 0
    progress: bool = True
    checkpoint_dir: str | None = None
    checkpoint_every: int = 50
    cache: str | None = None
    load_balance: bool = False
    shard: str | None = None
    autotune: bool = False
    out_dir: str = "runs"

    def get(self, name: str):
        """The field, or the model's default where it is None."""
        value = getattr(self, name, None)
        return MODEL_DEFAULTS[self.model][name] if value is None else value


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One entry of the registry.

    Attributes:
      kwargs: ``config -> Strategy keyword arguments``.
      takes_optimizer: False for an algorithm that is the optimizer itself (QAdam).
      min_processes: processes it needs to mean anything, and why.
    """

    kwargs: Callable[[Config], dict[str, Any]] = lambda config: {}
    takes_optimizer: bool = True
    min_processes: tuple[int, str] = (1, "")


def qadam_warning(config: Config) -> str | None:
    """What to say when QAdam's warm-up is too short to trust, else None."""
    warmup = _qadam(config)["warmup_steps"]
    if warmup >= QADAM_MIN_WARMUP:
        return None
    steps = -(-QADAM_MIN_WARMUP // config.qadam_warmup_fraction)
    return (
        f"qadam: a float32 warm-up of {warmup} steps ({config.qadam_warmup_fraction:.0%} of "
        f"{config.get('steps')}) is too short for the second moment it then freezes, and it "
        f"may diverge; pass --steps {steps:.0f} or more (docs/qadam.md, 'Warm-up length')"
    )


def _diloco(config: Config) -> dict[str, Any]:
    """DiLoCo's H, and the outer step docs/diloco.md recommends for H from 10 to 50: Nesterov
    SGD at 0.7 with momentum 0.6, within 5% of ByteGrad on this language model at 1000 steps
    where DiLoCo's own default (momentum 0.9) ended 39-41% above at H = 10."""
    return {
        "inner_steps": config.diloco_inner_steps,
        "outer_optimizer": optax.sgd(0.7, momentum=0.6, nesterov=True),
    }


def _qadam(config: Config) -> dict[str, Any]:
    # QAdam's defaults, Adam's eps included: its second moment keeps being updated after
    # warm-up (from the gradient recovered from the decoded momenta), and both models train
    # with eps 1e-8 (benchmarks/RESULTS.md,
    # "QAdam's second moment after warm-up"). The frozen one needed 1e-4 on the CNN.
    eps = {} if config.qadam_eps is None else {"eps": config.qadam_eps}
    return {
        "learning_rate": config.get("learning_rate"),
        "warmup_steps": max(1, int(config.qadam_warmup_fraction * config.get("steps"))),
        **eps,
    }


ALGORITHMS: dict[str, Algorithm] = {
    # Hierarchical: each device sends 1/L of the gradient between nodes, the strongest
    # float32 baseline. Bagua's default (False) would count 4x more inter-node bytes here.
    "gradient_allreduce": Algorithm(lambda config: {"hierarchical": True}),
    "bytegrad": Algorithm(),
    "qadam": Algorithm(_qadam, takes_optimizer=False),
    "decentralized": Algorithm(),
    "low_precision_decentralized": Algorithm(),
    "async": Algorithm(
        lambda config: {"sync_interval_ms": config.async_interval_ms},
        min_processes=(2, "async model averaging averages the model across processes"),
    ),
}
assert tuple(ALGORITHMS) == jax_bytegrad.ALGORITHMS, "one registry entry per library algorithm"

# What --algorithm takes besides Bagua's six: DiLoCo (docs/diloco.md), run by name only. The
# comparison (--compare) runs ALGORITHMS alone: the README records its table as printed.
EXTRA_ALGORITHMS: dict[str, Algorithm] = {
    "diloco": Algorithm(_diloco),
}
RUNNABLE = {**ALGORITHMS, **EXTRA_ALGORITHMS}
