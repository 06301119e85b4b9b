"""What ``autotune`` reports and remembers: its trials, its result and table, and the cache.

The search itself, and the references it follows, are in ``autotune.py``.
"""

import json
import math
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

# What a compressed step is compared with: the same optimizer after a float32 mean.
UNCOMPRESSED = "gradient_allreduce"


def label(config: Mapping[str, Any]) -> str:
    def show(v):
        if isinstance(v, int) and not isinstance(v, bool) and v >= 2**10:
            return f"{v / 2**20:g}MiB" if v >= 2**20 else f"{v / 2**10:g}KiB"
        return str(v)

    return " ".join(f"{k}={show(v)}" for k, v in config.items()) or "(defaults)"


def ratio(a: float, b: float) -> float:
    """a / b, NaN where either is NaN or b is not positive."""
    return a / b if b > 0 and not math.isnan(a) else math.nan


def param_count(params) -> int:
    return sum(int(np.size(x)) for x in jax.tree.leaves(params))


# Results -----------------------------------------------------------------------------------


class Trial(NamedTuple):
    """One measured configuration.

    Attributes:
      config: the tuned settings of this trial, by ``Strategy`` keyword.
      compile_s: seconds to build and compile the step (the first call minus a median step),
        slowest process; NaN if the trial failed.
      step_s: median seconds per step over the timed steps, slowest process; NaN if failed.
      error: why the trial failed (the exception, as text), or None.
    """

    config: dict[str, Any]
    compile_s: float
    step_s: float
    error: str | None = None


class AutotuneResult(NamedTuple):
    """What ``autotune`` found.

    Attributes:
      config: the fastest configuration (the settings that were tuned).
      strategy: a ``Strategy`` with that configuration and the original's other settings.
      trials: every trial in the order run (empty when the configuration came from the cache).
      start: the configuration the strategy would have run untuned.
      tuning_s: wall seconds ``autotune`` took, compiles included.
      from_cache: whether ``config`` was read from the cache instead of measured.
      uncompressed: the uncompressed step's trial (``gradient_allreduce`` with the same
        optimizer, ``config={}``), or None where it was not timed (an algorithm other than
        ByteGrad, ``compare_uncompressed=False``, no trial run). From the cache: its
        ``step_s`` as measured then, and NaN ``compile_s``.
      best_step_s: the chosen configuration's step seconds (NaN if not measured).
      fell_back: whether ``strategy`` is the uncompressed one (``prefer_uncompressed=True``
        and the best compressed step was slower); ``config`` stays the best compressed one.
      diloco: with ``link_bytes_per_s=``, the estimate of a DiLoCo inner step against the
        chosen ByteGrad step on that link (``algorithms/diloco/estimate.DiLoCoEstimate``);
        else None.
    """

    config: dict[str, Any]
    strategy: Any
    trials: list[Trial]
    start: dict[str, Any]
    tuning_s: float
    from_cache: bool
    uncompressed: Trial | None = None
    best_step_s: float = math.nan
    fell_back: bool = False
    diloco: Any = None

    @property
    def speedup(self) -> float:
        """The uncompressed step's time over the chosen compressed one's (``best_step_s``):
        above 1, compression pays on this link; below 1, the compressed step is slower. NaN
        where either is missing.
        """
        if self.uncompressed is None:
            return math.nan
        return ratio(self.uncompressed.step_s, self.best_step_s)

    def verdict(self) -> str:
        """One sentence: how the chosen compressed step compares with the uncompressed one."""
        speedup = self.speedup
        if math.isnan(speedup):
            return "the uncompressed step was not timed"
        how = "faster" if speedup >= 1 else "slower"
        factor = speedup if speedup >= 1 else 1 / speedup
        then = "; returned the uncompressed strategy" if self.fell_back else ""
        return (
            f"the chosen compressed step is {factor:.2f}x {how} than the uncompressed one "
            f"({UNCOMPRESSED}: {1e3 * self.uncompressed.step_s:.1f} ms, compressed: "
            f"{1e3 * self.best_step_s:.1f} ms){then}"
        )

    def table(self) -> str:
        """The trials as a Markdown table, fastest first, with the uncompressed step's row and
        each step's speed-up over it; then the verdict (``verdict()``)."""
        rows = [(label(t.config), t) for t in self.trials]
        if self.uncompressed is not None:
            rows.append((f"{UNCOMPRESSED} (uncompressed)", self.uncompressed))
        rows.sort(key=lambda row: (math.isnan(row[1].step_s), row[1].step_s))
        compared = self.uncompressed is not None
        base = self.uncompressed.step_s if compared else math.nan
        lines = [
            "| configuration | step ms |" + (" vs uncompressed |" if compared else "")
            + " compile s | note |",
            "|---|---:|" + ("---:|" if compared else "") + "---:|---|",
        ]  # fmt: skip
        for name, t in rows:
            note = []
            if t is self.uncompressed:
                note.append("returned" if self.fell_back else "baseline")
            elif t.config == self.config:
                note.append("best compressed" if self.fell_back else "chosen")
            if t is not self.uncompressed and t.config == self.start:
                note.append("start")
            if t.error:
                note.append(f"failed: {t.error}")
            cells = [name, "" if math.isnan(t.step_s) else f"{1e3 * t.step_s:.1f}"]
            if compared:
                speed = ratio(base, t.step_s)
                cells.append("" if math.isnan(speed) else f"{speed:.2f}x")
            cells.append("" if math.isnan(t.compile_s) else f"{t.compile_s:.1f}")
            lines.append("| " + " | ".join([*cells, ", ".join(note)]) + " |")
        if self.uncompressed is not None:
            lines += ["", f"Compression: {self.verdict()}."]
        if self.diloco is not None:
            lines += ["", f"DiLoCo (estimated from the link): {self.diloco.verdict()}."]
        return "\n".join(lines)


# The cache ---------------------------------------------------------------------------------


def cache_key(strat, params) -> str:
    """The cache's key for a strategy and model: algorithm, mesh, processes, backend,
    parameter count and the strategy's own settings (those are not tuned)."""
    fixed = ",".join(f"{k}={strat.kwargs[k]!r}" for k in sorted(strat.kwargs))
    mesh = ",".join(f"{k}={v}" for k, v in strat.mesh.shape.items())
    return (
        f"{strat.algorithm} mesh={mesh} processes={jax.process_count()} "
        f"backend={jax.default_backend()} params={param_count(params)} "
        f"flatten={strat.flatten} {fixed}"
    ).strip()


def read_cache(path: Path, key: str) -> dict[str, Any] | None:
    """The cache's entry for ``key``: ``config``, ``step_ms``, ``uncompressed_step_ms``, ..."""
    try:
        entry = json.loads(path.read_text()).get(key)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        warnings.warn(f"autotune: ignoring unreadable cache {path}: {e}", stacklevel=3)
        return None
    return entry if isinstance(entry, dict) else None


def write_cache(path: Path, key: str, result: AutotuneResult) -> None:
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}

    def ms(seconds):
        return None if seconds is None or math.isnan(seconds) else 1e3 * seconds

    entries[key] = {
        "config": result.config,
        "step_ms": ms(result.best_step_s),
        "uncompressed_step_ms": ms(result.uncompressed and result.uncompressed.step_s),
        "trials": len(result.trials),
        "saved": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
