"""QAdam's schedule of phases: which steps run float32 (warm-up and refreshes) and which
send the compressed momentum, on the host and inside the traced step.

The refresh follows 0/1 Adam (Lu et al., "Maximizing Communication Efficiency for
Large-scale Training via 0/1 Adam", ICLR 2023): the steps
``warmup_steps + round(k (1 + g + ... + g^j))`` run the warm-up step again.
"""

import bisect
import itertools
import math
from collections.abc import Callable
from typing import Literal

import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src import checks

_INT32_MAX = int(np.iinfo(np.int32).max)
# Longest refresh schedule compiled into a step: growth 1.001 from k = 1 needs ~15,000.
_MAX_REFRESH_TABLE = 1 << 16

Phase = Literal["warmup", "compressed"]


def check_warmup_steps(warmup_steps, where: str) -> None:
    checks.integer(
        warmup_steps,
        "warmup_steps",
        where,
        maximum=_INT32_MAX,
        why="; QAdam starts its second moment from float32 Adam steps, so it needs at least "
        "one (10-30% of the run is a good default)",
    )


def check_refresh(interval, growth, where: str) -> None:
    checks.integer(
        interval,
        "nu_refresh_interval",
        where,
        maximum=_INT32_MAX,
        or_none=True,
        why=" (the compressed steps after warm-up before the first float32 refresh of the "
        "second moment; None: never refresh)",
    )
    checks.real(
        growth,
        "nu_refresh_growth",
        where,
        minimum=1.0,
        why=" (each gap between refreshes over the previous one; 1.0: a fixed interval)",
    )


def _schedule(warmup_steps: int, interval: int, growth: float, last: int):
    """Yields the refresh steps ``warmup_steps + round(k (1 + g + ... + g^j))`` up to
    ``last``."""
    offset, gap = 0.0, float(interval)
    while True:
        offset += gap
        # Round half up on the running sum: it grows by >= 1 per refresh, so the steps
        # strictly increase; integer k and g give the exact sums.
        step = warmup_steps + math.floor(offset + 0.5)
        if step > last:
            return
        yield step
        gap *= growth


def _refresh_table(warmup_steps: int, interval: int, growth: float, where: str) -> np.ndarray:
    """The refresh steps of a growing schedule up to int32's end (a few dozen steps for
    g = 2), computed where a transform or step builder reads its schedule."""
    steps = _schedule(warmup_steps, interval, growth, _INT32_MAX)
    table = np.fromiter(itertools.islice(steps, _MAX_REFRESH_TABLE + 1), np.int32)
    if table.size > _MAX_REFRESH_TABLE:
        raise ValueError(
            f"{where}: nu_refresh_growth={growth!r} with nu_refresh_interval={interval!r} "
            f"schedules more than {_MAX_REFRESH_TABLE} refreshes; pass "
            "nu_refresh_growth=1.0 for a fixed interval, or a growth of at least 1.001"
        )
    return table


def refresh_counter(warmup_steps: int, interval: int | None, growth: float, where: str):
    """``t -> (is t a refresh step, refreshes up to and including t)``, traced on device.

    A fixed interval is a modulus; a growing one looks ``t`` up in the schedule, compiled in
    as a constant, so no step's program depends on where the run stands. None without an
    interval, or when no refresh fits in int32 steps.
    """
    if interval is None:
        return None
    if growth == 1.0:

        def count(t):
            since = jnp.maximum(t - warmup_steps, 0)
            return (since > 0) & (since % interval == 0), since // interval

        return count

    table = _refresh_table(warmup_steps, interval, growth, where)
    if table.size == 0:
        return None  # the first refresh would fall beyond int32's last step

    def count(t):
        steps = jnp.asarray(table)  # a constant of the traced program
        done = jnp.searchsorted(steps, t, side="right").astype(jnp.int32)
        last = steps[jnp.maximum(done - 1, 0)]
        return (done > 0) & (last == t), done

    return count


def phase_schedule(
    warmup_steps: int, nu_refresh_interval: int | None = None, nu_refresh_growth: float = 2.0
) -> Callable[[int], Phase]:
    """The phase of every step, on the host: ``phase(steps_taken) -> "warmup" | "compressed"``.

    A refresh step is a warm-up step. Step builders compile one program per phase and pick
    it with this, so no collective sits inside a ``lax.cond`` and each program fuses whole.

    Examples:
      >>> from jax_bytegrad._src.algorithms.qadam.schedule import phase_schedule
      >>> phase = phase_schedule(2, nu_refresh_interval=3, nu_refresh_growth=1.0)
      >>> [phase(i) for i in range(6)]
      ['warmup', 'warmup', 'compressed', 'compressed', 'warmup', 'compressed']
    """
    where = "phase_schedule"
    check_warmup_steps(warmup_steps, where)
    check_refresh(nu_refresh_interval, nu_refresh_growth, where)
    growth = float(nu_refresh_growth)
    table = None
    if nu_refresh_interval is not None and growth != 1.0:
        table = _refresh_table(warmup_steps, nu_refresh_interval, growth, where)

    def phase(steps_taken: int) -> Phase:
        t = steps_taken + 1
        if t <= warmup_steps:
            return "warmup"
        if nu_refresh_interval is None:
            return "compressed"
        if table is None:
            refresh = (t - warmup_steps) % nu_refresh_interval == 0
        else:
            i = bisect.bisect_left(table, t)
            refresh = i < table.size and table[i] == t
        return "warmup" if refresh else "compressed"

    return phase


def refresh_steps(
    warmup_steps: int, nu_refresh_interval: int, nu_refresh_growth: float, num_steps: int
) -> list[int]:
    """The steps ``t <= num_steps`` (counted from 1) on which QAdam refreshes its ``v``.

    They are ``warmup_steps + round(k (1 + g + ... + g^j))`` for ``j = 0, 1, ...``, with
    ``k = nu_refresh_interval`` and ``g = nu_refresh_growth``: the first ``k`` steps after
    warm-up, then gaps ``k g``, ``k g^2``, ... (halves round up). Every gap is at least 1.

    Args:
      warmup_steps: QAdam's warm-up length.
      nu_refresh_interval: the first gap, an int >= 1.
      nu_refresh_growth: each gap over the previous one, a float >= 1.
      num_steps: the last step to list.

    Returns:
      The refresh steps, ascending.

    Raises:
      ValueError: for a bad interval or growth.

    Examples:
      >>> refresh_steps(10, 4, 2.0, 60)
      [14, 22, 38]
    """
    where = "refresh_steps"
    check_warmup_steps(warmup_steps, where)
    check_refresh(nu_refresh_interval, nu_refresh_growth, where)
    return list(_schedule(warmup_steps, nu_refresh_interval, nu_refresh_growth, num_steps))
