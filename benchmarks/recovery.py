"""Time to recover from a killed worker: detection, restart, restore and recompilation.

Runs ``python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 --max-restarts 1`` on
tests/_mp_scripts/elastic_worker.py (ByteGrad on a small MLP, a checkpoint every 2 steps), whose
rank 1 kills itself with SIGKILL after step 4 on the first attempt, and times the launcher's
output lines as they arrive. With ``--compilation-cache`` the processes share JAX's persistent
compilation cache, so the restarted attempt loads its programs instead of compiling them.

Usage::

    python benchmarks/recovery.py [--compilation-cache] [--repeats 3]
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "_mp_scripts" / "elastic_worker.py"


def run(cache_dir: str | None) -> list[tuple[float, str]]:
    """Runs the killed-and-restarted job; returns (seconds since start, line) for each line."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)
    if cache_dir is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    with tempfile.TemporaryDirectory() as out_dir:
        start = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "jax_bytegrad.launch", "--nproc", "2",
             "--devices-per-proc", "4", "--max-restarts", "1", "--grace", "2", str(WORKER),
             out_dir, "--algorithms", "bytegrad", "--kill-step", "4"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        lines = [(time.monotonic() - start, line.rstrip("\n")) for line in proc.stdout]
        if proc.wait() != 0:
            sys.exit("\n".join(line for _, line in lines))
    return lines


def first(lines, *needles, after: float = -1.0) -> float:
    """Time of the first line after `after` that contains every needle."""
    for t, line in lines:
        if t > after and all(n in line for n in needles):
            return t
    raise SystemExit(f"no line with {needles} after {after:.1f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compilation-cache", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="runs; medians are shown")
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:  # a fresh cache: the first attempt fills it
            runs.append(phases(run(cache if args.compilation_cache else None)))
    cache = "with" if args.compilation_cache else "without"
    resumed = sorted({r[0] for r in runs})
    print(f"recovery from SIGKILL, {cache} the persistent compilation cache, median of "
          f"{args.repeats} runs; resumed at step(s) {resumed}")  # fmt: skip
    print("| phase | seconds |\n|---|---:|")
    for i, (name, _) in enumerate(runs[0][1]):
        print(f"| {name} | {statistics.median(r[1][i][1] for r in runs):.1f} |")


def phases(lines):
    """(the step resumed at, [(phase, seconds)]) of one run's timed lines."""
    start0 = first(lines, "[rank 0] bytegrad: starts at step")
    step1 = first(lines, "[rank 0] bytegrad: step 1 ")
    killed = first(lines, "[rank 1] killing myself")
    restarted = first(lines, "[launch]", "restart 1 of 1")
    resumed = first(lines, "[rank 0] bytegrad: starts at step", after=restarted)
    resumed_step = next(line for t, line in lines if t == resumed).rsplit(" ", 1)[1]
    next_step = first(lines, "[rank 0] bytegrad: step", after=resumed)
    rows = [
        ("first attempt: start to restored-or-initialized state", start0),
        ("first attempt: first step (compilation)", step1 - start0),
        ("detect the death and stop all (grace 2 s)", restarted - killed),
        ("restart: processes up, jax.distributed joined, state restored", resumed - restarted),
        ("first step after the restart (compilation)", next_step - resumed),
        ("recovery in all (death to next step)", next_step - killed),
    ]
    return int(resumed_step), rows


if __name__ == "__main__":
    main()
