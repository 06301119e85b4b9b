"""Starts N local processes of one script as one multi-process JAX run.

``python -m jax_bytegrad.launch`` is for try-outs and tests on one machine; clusters use ``srun`` or
``mpirun``, which `jax_bytegrad.initialize` detects. Each process gets the ``JAX_BYTEGRAD_*``
environment variables that `jax_bytegrad.initialize` reads (the coordinator on 127.0.0.1 and a
free port, the process count, its id and its CPU device count), so the script only calls
``jax_bytegrad.initialize()``.

Usage::

    python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 [--port P] [--timeout S] \\
        [--no-hugepages] [--max-restarts N] [--progress-timeout S] script.py [args ...]

The launcher owns the process-wide settings of its workers, through their environment; a
value already in the launcher's environment wins, so ``JAX_BYTEGRAD_QUIET=0 python -m
jax_bytegrad.launch ...`` shows everything every rank prints, Gloo's connection lines included:

- ``JAX_BYTEGRAD_FAIL_FAST=1``: `jax_bytegrad.initialize` makes an uncaught exception end the
  process at once (its ``fail_fast``), so that the launcher sees the failure instead of a
  process hung at exit;
- ``JAX_BYTEGRAD_QUIET=1``: on ranks other than 0, what native code prints to stdout (Gloo's
  connection lines) is dropped (its ``quiet``); and the launcher leaves out of every rank's
  output, on every attempt alike, Gloo's connection reports (``[Gloo] Rank 0 is connected to 3
  peer ranks. Expected number of connected peer ranks is : 3``, one per device and collective
  group), whole or torn into pieces by the threads that print them at once, and the
  ``preemption_notifier.cc:NN] SIGTERM caught`` lines of workers it is stopping. A whole
  report of fewer peers than expected is kept;
- ``NPROC``: XLA:CPU's thread pool, sized for ``--devices-per-proc`` devices
  (`jax_bytegrad.distributed.ensure_cpu_threads`);
- ``JAX_PLATFORMS=cpu`` and ``PYTHONUNBUFFERED=1``;
- ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, below.

The processes run with glibc's large allocations on transparent huge pages
(``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, glibc >= 2.35): XLA:CPU allocates fresh buffers of
the gradient's size every step, and with 4 KiB pages most of a compressed sync's CPU time goes
to page faults (benchmarks/RESULTS.md). ``--no-hugepages`` leaves the allocator as it is.

Each line a process prints is echoed whole as ``[rank k] line``, one line at a time, so lines of
different ranks never interleave. If one process fails (non-zero exit or killed by a signal),
the launcher names the first to end and stops the others (SIGTERM to each process group, SIGKILL
after ``--grace`` seconds) and exits non-zero; likewise on Ctrl-C, SIGTERM or ``--timeout``. It
exits 0 only if every process exits 0. A worker that called ``jax.distributed.initialize``
ignores SIGTERM (JAX's preemption notifier catches it, in JAX 0.10.2 to 0.12), so it goes only
at the SIGKILL, ``--grace`` seconds later.

Restarts (``--max-restarts N``, after torchrun's ``--max-restarts``): when a process fails, or
stops making progress, all processes are stopped and all started again, up to N times, each
time with ``JAX_BYTEGRAD_RESTART`` one higher (`jax_bytegrad.distributed.restart_count`); the
script resumes from its last checkpoint (`jax_bytegrad.checkpoint`). Ctrl-C, SIGTERM and
``--timeout`` are never restarted. ``[launch]`` lines say why each attempt ended and how many
restarts were used.

A failure that no restart can cure is not retried:

- a script that does not exist, or cannot be read, is an error before anything starts (exit
  status 2, as for any other bad argument);
- a process that exits with status 2 ends the run at once: 2 is what Python returns for a
  script it cannot open and what argparse returns for bad arguments, errors of the command
  line that every attempt would repeat. A script that wants its failures retried exits with
  another status (an uncaught exception gives 1).

A hang is a process that goes ``--progress-timeout`` seconds without calling
`jax_bytegrad.distributed.report_progress` (which touches a file the launcher watches); the
first call must come within that time of the start, compilation included. This, rather than
`jax.distributed`'s heartbeat, is the test of a hang: the heartbeat runs on its own thread and
says the process is alive, not that it is training, so it misses a process deadlocked in a
collective, and on its own timeout it ends the whole job instead of letting it restart.

References:
  - ``torchrun``, whose fail-fast behaviour this follows:
    https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

from jax_bytegrad._src import checks
from jax_bytegrad._src.runtime.cluster import (
    COORDINATOR_ENV,
    CPU_DEVICES_ENV,
    FAIL_FAST_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    PROGRESS_FILE_ENV,
    QUIET_ENV,
    RESTART_ENV,
    ensure_cpu_threads,
)
from jax_bytegrad._src.runtime.hugepages import with_hugepages
from jax_bytegrad._src.runtime.worker_output import NoiseFilter, pump

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130
EXIT_HUNG = 125
EXIT_USAGE = 2  # Python's status for a script it cannot open, argparse's for bad arguments

_PREFIX = "[launch] "


# Private helpers ----------------------------------------------------------------------------------


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(
            proc.pid, sig
        )  # each child leads its own group: this also reaches its own children
    except (ProcessLookupError, PermissionError):
        pass


def _stop_all(procs: Sequence[subprocess.Popen], grace: float) -> None:
    """SIGTERM every live process group, then SIGKILL whatever is left after `grace` seconds."""
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            _signal_group(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=5)
        except (
            subprocess.TimeoutExpired
        ):  # pragma: no cover - unkillable (D state); do not hang on it
            pass
    # A survivor grandchild may still hold a group member; sweep the groups once more.
    for p in procs:
        _signal_group(p, signal.SIGKILL)


def _say(out, lock: threading.Lock, message: str) -> None:
    with lock:
        out.write((_PREFIX + message + "\n").encode())
        out.flush()


def _describe(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


def _last_progress(path: Path, since: float) -> tuple[float, str | None]:
    """(wall time of the last progress report, or `since` if none; the step it named).

    The file is removed before each attempt starts, so one that exists is this attempt's. Its
    time is taken no earlier than `since`: the kernel stamps files from a clock that may lag
    ``time.time()`` by a tick.
    """
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return since, None
    try:
        step = path.read_text().strip() or None
    except OSError:  # pragma: no cover - removed between stat and read
        step = None
    return max(mtime, since), step


@dataclasses.dataclass
class _Run:
    """What every attempt of one launch shares."""

    command: Sequence[str] | Callable[[int], Sequence[str]]
    nproc: int
    env: dict[str, str]
    coordinator_host: str
    port: int | None
    grace: float
    progress_timeout: float | None
    deadline: float | None
    timeout: float | None
    out: object
    lock: threading.Lock
    received: list[int]


class _Outcome(NamedTuple):
    """How one attempt ended: the exit code, why, and whether a restart may help."""

    code: int
    reason: str
    restartable: bool


@dataclasses.dataclass
class _Attempt:
    """The processes of one attempt, and what their threads report.

    Each process has a thread that copies its output (`pump`) and one that waits for it and
    appends ``(rank, exit code)`` to `exits`, in the order those threads get to run once their
    processes ended: near enough the order the processes ended, but not under load, where a
    process killed with SIGKILL and its peer failing in a collective a moment later may be
    appended either way round (`_blamed` sorts that out).
    """

    procs: list[subprocess.Popen] = dataclasses.field(default_factory=list)
    threads: list[threading.Thread] = dataclasses.field(default_factory=list)
    exits: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)

    def spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)


def _start(run: _Run, attempt_number: int, progress_dir: Path, attempt: _Attempt) -> None:
    """Starts the `run.nproc` processes of one attempt, with their output and exit threads."""
    port = run.port if run.port is not None else checks.free_port()
    quiet = run.env.get(QUIET_ENV) == "1"
    for rank in range(run.nproc):
        proc_env = dict(run.env)
        proc_env[COORDINATOR_ENV] = f"{run.coordinator_host}:{port}"
        proc_env[NUM_PROCESSES_ENV] = str(run.nproc)
        proc_env[PROCESS_ID_ENV] = str(rank)
        proc_env[RESTART_ENV] = str(attempt_number)
        proc_env[PROGRESS_FILE_ENV] = str(progress_dir / f"rank{rank}")
        (progress_dir / f"rank{rank}").unlink(missing_ok=True)  # the last attempt's
        p = subprocess.Popen(
            list(run.command(rank) if callable(run.command) else run.command),
            env=proc_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            # Its own process group: Ctrl-C reaches only the launcher, which then stops the
            # whole group, the script's own children included.
            start_new_session=True,
        )
        attempt.procs.append(p)
        noise = NoiseFilter(attempt.stopping) if quiet else None
        attempt.spawn(pump, rank, p.stdout, run.out, run.lock, noise)
        attempt.spawn(lambda rank, p: attempt.exits.append((rank, p.wait())), rank, p)


def _ended(p: subprocess.Popen) -> bool:
    """Whether ``p`` has ended, without reaping it (its thread does): a zombie, or reaped."""
    try:
        return os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _blamed(attempt: _Attempt, settle_s: float = 5.0) -> tuple[int, int]:
    """``(rank, exit code)`` of the failure an attempt is blamed on, once `exits` holds one.

    Every process that has ended by now is waited for in `exits` (up to ``settle_s``): its
    thread may not have run yet. Then a process killed by a signal is blamed before one that
    exited with an error, whatever order the threads appended them in: a signal comes from
    outside the script (a kill, the OOM killer), and an error exit at the same moment is what
    its peers do when a collective loses it. Among the rest, the first appended.
    """
    if hasattr(os, "waitid"):  # (not on macOS: there, the order appended)
        ended = {rank for rank, p in enumerate(attempt.procs) if _ended(p)}
        deadline = time.monotonic() + settle_s
        while not ended <= {r for r, _ in attempt.exits} and time.monotonic() < deadline:
            time.sleep(0.01)
    failed = [(r, c) for r, c in list(attempt.exits) if c != 0]
    return min(failed, key=lambda rc: rc[1] >= 0)  # min keeps the first of equals


def _watch(run: _Run, attempt: _Attempt, progress_dir: Path, started: float) -> _Outcome:
    """Waits until the attempt ends: all exited 0, one failed or hung, a signal, or the timeout.

    `started` is the attempt's wall-clock start (progress files carry wall-clock times).
    """
    while True:
        if run.received:
            sig = run.received[0]
            code = EXIT_INTERRUPTED if sig == signal.SIGINT else 128 + sig
            return _Outcome(code, f"got {signal.Signals(sig).name}", False)
        exits = list(attempt.exits)
        if any(c != 0 for _, c in exits):
            rank, c = _blamed(attempt)
            if c == EXIT_USAGE:
                reason = f"rank {rank} {_describe(c)}, a usage error that no restart can cure"
                return _Outcome(c, reason, False)
            return _Outcome(128 - c if c < 0 else c, f"rank {rank} {_describe(c)}", True)
        if len(exits) == run.nproc:
            return _Outcome(0, f"all {run.nproc} processes exited 0", False)
        if run.deadline is not None and time.monotonic() > run.deadline:
            return _Outcome(EXIT_TIMEOUT, f"timed out after {run.timeout:g} s", False)
        if run.progress_timeout is not None:
            now, ended = time.time(), {r for r, _ in exits}
            stalled = []
            for rank in range(run.nproc):
                last, step = _last_progress(progress_dir / f"rank{rank}", started)
                if rank not in ended and now - last > run.progress_timeout:
                    at = f"after step {step}" if step is not None else "before its first step"
                    stalled.append(f"rank {rank} ({at})")
            if stalled:
                reason = f"no progress for {run.progress_timeout:g} s from " + ", ".join(stalled)
                return _Outcome(EXIT_HUNG, reason, True)
        time.sleep(0.05)


def _run_attempt(run: _Run, attempt_number: int, progress_dir: Path) -> _Outcome:
    """Runs one attempt to its end and leaves no process of it running."""
    attempt = _Attempt()
    started = time.time()
    try:
        _start(run, attempt_number, progress_dir, attempt)
        return _watch(run, attempt, progress_dir, started)
    finally:
        attempt.stopping.set()  # before any signal: what the workers say of it is the launcher's
        _stop_all(attempt.procs, run.grace)
        for t in attempt.threads:
            t.join(timeout=5)


def _restart_loop(run: _Run, max_restarts: int, progress_dir: Path) -> int:
    """Runs attempts until one ends for good or `max_restarts` restarts are used."""
    attempt = 0
    while True:
        outcome = _run_attempt(run, attempt, progress_dir)
        used = f"{attempt} of {max_restarts} restart(s) used"
        if outcome.code == 0:
            if max_restarts:
                _say(run.out, run.lock, f"{outcome.reason}; {used}")
            return 0
        if not outcome.restartable:
            _say(run.out, run.lock, f"{outcome.reason}; stopped all {run.nproc} processes; {used}")
            return outcome.code
        if attempt == max_restarts:
            if max_restarts:
                message = f"out of restarts: {outcome.reason}; {used}; exiting with {outcome.code}"
            else:
                message = f"{outcome.reason}; stopped all {run.nproc} processes"
            _say(run.out, run.lock, message)
            return outcome.code
        attempt += 1
        _say(
            run.out,
            run.lock,
            f"{outcome.reason}; stopped all {run.nproc} processes; "
            f"restart {attempt} of {max_restarts}",
        )


def _check_launch_args(
    command, nproc, devices_per_proc, timeout, port, max_restarts, progress_timeout
) -> None:
    if not callable(command) and not command:
        raise ValueError("launch: empty command; pass the script to run, e.g. ['train.py']")
    if nproc < 1:
        raise ValueError(f"launch: nproc={nproc} must be at least 1")
    if devices_per_proc < 1:
        raise ValueError(f"launch: devices_per_proc={devices_per_proc} must be at least 1")
    if timeout is not None and timeout <= 0:
        raise ValueError(
            f"launch: timeout={timeout} must be positive seconds, or None for no limit"
        )
    if port is not None and not 0 < port < 65536:
        raise ValueError(
            f"launch: port={port} is not a TCP port; pass 1..65535 or leave it out for a free one"
        )
    checks.integer(max_restarts, "max_restarts", "launch", minimum=0, why=" (0: no restart)")
    if progress_timeout is not None and progress_timeout <= 0:
        raise ValueError(
            f"launch: progress_timeout={progress_timeout} must be positive seconds, or None to "
            "never declare a hang"
        )


def _worker_env(env: Mapping[str, str] | None, hugepages: bool, devices_per_proc: int) -> dict:
    """The environment every worker starts from (the layout variables are added per rank)."""
    base_env = dict(os.environ if env is None else env)
    if hugepages:
        base_env = with_hugepages(base_env)
    base_env.setdefault("JAX_PLATFORMS", "cpu")
    base_env["PYTHONUNBUFFERED"] = "1"  # so lines arrive as they are printed, not at exit
    base_env[CPU_DEVICES_ENV] = str(devices_per_proc)
    base_env.setdefault(FAIL_FAST_ENV, "1")
    base_env.setdefault(QUIET_ENV, "1")
    ensure_cpu_threads(devices_per_proc, base_env)
    return base_env


@contextlib.contextmanager
def _signals_recorded(received: list):
    """Appends SIGINT/SIGTERM to ``received`` instead of dying, while the block runs.

    The restart loop reads the list and stops every worker; only the main thread may set
    handlers, so elsewhere nothing changes.
    """
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# Public API ---------------------------------------------------------------------------------------


def launch(
    command: Sequence[str] | Callable[[int], Sequence[str]],
    nproc: int,
    *,
    devices_per_proc: int = 1,
    coordinator_host: str = "127.0.0.1",
    port: int | None = None,
    timeout: float | None = None,
    grace: float = 5.0,
    env: Mapping[str, str] | None = None,
    hugepages: bool = True,
    max_restarts: int = 0,
    progress_timeout: float | None = None,
    out=None,
) -> int:
    """Runs `command` as `nproc` cooperating local processes and returns the launcher's exit code.

    If a process fails, or (with `progress_timeout`) some process stops reporting progress, every
    process of the attempt is stopped; with restarts left, all `nproc` are started again, with
    ``JAX_BYTEGRAD_RESTART`` one higher (`jax_bytegrad.distributed.restart_count`), and the
    script resumes from its own last checkpoint (`jax_bytegrad.checkpoint`). A process that
    exits with status 2 (a usage error) is not restarted.

    Besides the layout, each process's environment gets ``JAX_BYTEGRAD_FAIL_FAST=1``,
    ``JAX_BYTEGRAD_QUIET=1`` and ``NPROC`` (see the module's docstring), unless `env` sets them.
    Every line a process prints reaches `out` whole, prefixed with its rank. With
    ``JAX_BYTEGRAD_QUIET=1``, Gloo's reports of connections that went as expected (whole, or
    torn by the threads that print them) and JAX's echo of the launcher's own SIGTERM are left
    out of it, on every attempt alike.

    Args:
      command: The program and its arguments, e.g. ``[sys.executable, "train.py"]``, or a
        function from the rank to them (to run each rank elsewhere, say in its own network
        namespace).
      nproc: Number of processes, at least 1.
      devices_per_proc: CPU devices each process exposes (``JAX_BYTEGRAD_CPU_DEVICES``).
      coordinator_host: Address of rank 0 that every rank can reach.
      port: Coordinator port; None picks one that is free on this machine (a new one for each
        attempt).
      timeout: Seconds, over all attempts, after which every process is stopped and 124
        returned; None for no limit.
      grace: Seconds between SIGTERM and SIGKILL when stopping processes.
      env: Base environment for the processes; None uses this process's.
      hugepages: run the processes with glibc's large allocations on transparent huge pages
        (see `with_hugepages`); a ``glibc.malloc.hugetlb`` setting already in ``env`` wins.
      max_restarts: How many times to restart all processes after a failure or a hang.
      progress_timeout: Seconds a process may go without calling
        `jax_bytegrad.distributed.report_progress` (counted from the start of the attempt until
        its first call) before the attempt counts as hung; None never declares a hang.
      out: Binary stream for the rank-prefixed output; None uses ``sys.stdout.buffer``.

    Returns:
      0 if every process of an attempt exited 0; else the exit code of the last attempt: the
      first failing process's code (128 + signal if it was killed; 2 is never restarted), 125
      if it hung; 124 on timeout; 130 on Ctrl-C and 143 on SIGTERM (neither is restarted).

    Raises:
      ValueError: `nproc`, `devices_per_proc`, `timeout`, `port`, `max_restarts` or
        `progress_timeout` is out of range, or `command` is empty.

    Examples:
      >>> import sys
      >>> from jax_bytegrad.launch import launch
      >>> launch([sys.executable, "-c", "print('hi')"], nproc=2)  # doctest: +SKIP
      [rank 0] hi
      [rank 1] hi
      0
    """
    _check_launch_args(
        command, nproc, devices_per_proc, timeout, port, max_restarts, progress_timeout
    )
    run = _Run(
        command=command,
        nproc=nproc,
        env=_worker_env(env, hugepages, devices_per_proc),
        coordinator_host=coordinator_host,
        port=port,
        grace=grace,
        progress_timeout=progress_timeout,
        deadline=None if timeout is None else time.monotonic() + timeout,
        timeout=timeout,
        out=out if out is not None else sys.stdout.buffer,
        lock=threading.Lock(),
        received=[],
    )
    with _signals_recorded(run.received):
        with tempfile.TemporaryDirectory(prefix="jax_bytegrad_progress_") as progress_dir:
            return _restart_loop(run, max_restarts, Path(progress_dir))


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of ``python -m jax_bytegrad.launch``; returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="python -m jax_bytegrad.launch",
        description="Start N local processes of a JAX script that calls jax_bytegrad.initialize().",
    )
    parser.add_argument("--nproc", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-proc", type=int, default=1, help="CPU devices per process (default 1)"
    )
    parser.add_argument(
        "--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="stop everything after this many seconds"
    )
    parser.add_argument(
        "--grace", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (default 5)"
    )
    parser.add_argument(
        "--no-hugepages",
        dest="hugepages",
        action="store_false",
        help="leave glibc's malloc on 4 KiB pages (default: GLIBC_TUNABLES=glibc.malloc.hugetlb=1)",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart all processes up to this many times after a failure or hang (default 0)",
    )
    parser.add_argument(
        "--progress-timeout",
        type=float,
        default=None,
        help="restart (or stop) when a process goes this many seconds without "
        "jax_bytegrad.distributed.report_progress() (default: never)",
    )
    parser.add_argument("script", help="Python script to run in each process")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    ns = parser.parse_args(argv)
    script = Path(ns.script)
    if not script.is_file() or not os.access(script, os.R_OK):
        why = "is not a readable file" if script.exists() else "does not exist"
        parser.error(f"launch: script {ns.script!r} {why}; pass the path of the Python file to run")
    try:
        return launch(
            [sys.executable, ns.script, *ns.args],
            ns.nproc,
            devices_per_proc=ns.devices_per_proc,
            port=ns.port,
            timeout=ns.timeout,
            grace=ns.grace,
            hugepages=ns.hugepages,
            max_restarts=ns.max_restarts,
            progress_timeout=ns.progress_timeout,
        )
    except ValueError as e:
        parser.error(str(e))
        return 2  # pragma: no cover - parser.error exits
