"""Starts N local processes of one script as one multi-process JAX run.

``python -m jax_bytegrad.launch`` is for try-outs and tests on one machine; clusters use ``srun`` or
``mpirun``, which `jax_bytegrad.initialize` detects. Each process gets the ``JAX_BYTEGRAD_*``
environment variables that `jax_bytegrad.initialize` reads (the coordinator on 127.0.0.1 and a
free port, the process count, its id and its CPU device count), so the script only calls
``jax_bytegrad.initialize()``.

Usage::

    python -m jax_bytegrad.launch --nproc 2 --devices-per-proc 4 [--port P] [--timeout S] \\
        [--no-hugepages] script.py [args ...]

The processes run with glibc's large allocations on transparent huge pages
(``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``, glibc >= 2.35): XLA:CPU allocates fresh buffers of
the gradient's size every step, and with 4 KiB pages most of a compressed sync's CPU time goes
to page faults (benchmarks/RESULTS.md). ``--no-hugepages`` leaves the allocator as it is.

Each line a process prints is echoed as ``[rank k] line``. If one process fails (non-zero exit or
killed by a signal), the launcher stops the others (SIGTERM to each process group, SIGKILL after
``--grace`` seconds) and exits non-zero; likewise on Ctrl-C, SIGTERM or ``--timeout``. It exits 0
only if every process exits 0.

References:
  - ``torchrun``, whose fail-fast behaviour this follows:
    https://pytorch.org/docs/stable/elastic/run.html
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from jax_bytegrad.distributed import (
    COORDINATOR_ENV,
    CPU_DEVICES_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
)

EXIT_TIMEOUT = 124
EXIT_INTERRUPTED = 130

_PREFIX = "[launch] "
HUGEPAGES_TUNABLE = "glibc.malloc.hugetlb=1"


# Private helpers ----------------------------------------------------------------------------------


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _pump(rank: int, stream, out, lock: threading.Lock) -> None:
    """Copies a process's output to `out` line by line, each line prefixed with its rank."""
    prefix = f"[rank {rank}] ".encode()
    for line in iter(stream.readline, b""):
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()


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


# Public API ---------------------------------------------------------------------------------------


def with_hugepages(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with glibc's malloc on transparent huge pages, unless it already says otherwise.

    glibc reads its tunables once, when a process starts, so this is for the environment of
    processes yet to start; other tunables in ``GLIBC_TUNABLES`` are kept.
    """
    env = dict(env)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
        env["GLIBC_TUNABLES"] = ":".join([*tunables, HUGEPAGES_TUNABLE])
    return env


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
    out=None,
) -> int:
    """Runs `command` as `nproc` cooperating local processes and returns the launcher's exit code.

    Args:
      command: The program and its arguments, e.g. ``[sys.executable, "train.py"]``, or a
        function from the rank to them (to run each rank elsewhere, say in its own network
        namespace).
      nproc: Number of processes, at least 1.
      devices_per_proc: CPU devices each process exposes (``JAX_BYTEGRAD_CPU_DEVICES``).
      coordinator_host: Address of rank 0 that every rank can reach.
      port: Coordinator port; None picks one that is free on this machine.
      timeout: Seconds after which every process is stopped and 124 returned; None for no limit.
      grace: Seconds between SIGTERM and SIGKILL when stopping processes.
      env: Base environment for the processes; None uses this process's.
      hugepages: run the processes with glibc's large allocations on transparent huge pages
        (see `with_hugepages`); a ``glibc.malloc.hugetlb`` setting already in ``env`` wins.
      out: Binary stream for the rank-prefixed output; None uses ``sys.stdout.buffer``.

    Returns:
      0 if every process exited 0; else the first failing process's exit code (128 + signal if
      it was killed); 124 on timeout; 130 on Ctrl-C and 143 on SIGTERM.

    Raises:
      ValueError: `nproc`, `devices_per_proc`, `timeout` or `port` is out of range, or
        `command` is empty.

    Examples:
      >>> import sys
      >>> from jax_bytegrad.launch import launch
      >>> launch([sys.executable, "-c", "print('hi')"], nproc=2)  # doctest: +SKIP
      [rank 0] hi
      [rank 1] hi
      0
    """
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
    out = out if out is not None else sys.stdout.buffer
    port = port if port is not None else _free_port()
    base_env = dict(os.environ if env is None else env)
    if hugepages:
        base_env = with_hugepages(base_env)
    base_env.setdefault("JAX_PLATFORMS", "cpu")
    base_env["PYTHONUNBUFFERED"] = "1"  # so lines arrive as they are printed, not at exit

    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    received: list[int] = []

    def on_signal(signum, _frame):
        received.append(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)

    code = 0
    try:
        for rank in range(nproc):
            proc_env = dict(base_env)
            proc_env[COORDINATOR_ENV] = f"{coordinator_host}:{port}"
            proc_env[NUM_PROCESSES_ENV] = str(nproc)
            proc_env[PROCESS_ID_ENV] = str(rank)
            proc_env[CPU_DEVICES_ENV] = str(devices_per_proc)
            p = subprocess.Popen(
                list(command(rank) if callable(command) else command),
                env=proc_env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                # Its own process group: Ctrl-C reaches only the launcher, which then stops the
                # whole group, the script's own children included.
                start_new_session=True,
            )
            procs.append(p)
            t = threading.Thread(target=_pump, args=(rank, p.stdout, out, lock), daemon=True)
            t.start()
            pumps.append(t)

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if received:
                sig = received[0]
                _say(out, lock, f"got {signal.Signals(sig).name}; stopping all {nproc} processes")
                code = EXIT_INTERRUPTED if sig == signal.SIGINT else 128 + sig
                break
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, c = failed[0]
                alive = sum(c is None for c in codes)
                _say(
                    out,
                    lock,
                    f"rank {rank} {_describe(c)}; stopping the {alive} other running process(es)",
                )
                code = 128 - c if c < 0 else c
                break
            if all(c == 0 for c in codes):
                code = 0
                break
            if deadline is not None and time.monotonic() > deadline:
                _say(out, lock, f"timed out after {timeout:g} s; stopping all processes")
                code = EXIT_TIMEOUT
                break
            time.sleep(0.05)
    finally:
        _stop_all(procs, grace)
        for t in pumps:
            t.join(timeout=5)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code


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
    parser.add_argument("script", help="Python script to run in each process")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    ns = parser.parse_args(argv)
    try:
        return launch(
            [sys.executable, ns.script, *ns.args],
            ns.nproc,
            devices_per_proc=ns.devices_per_proc,
            port=ns.port,
            timeout=ns.timeout,
            grace=ns.grace,
            hugepages=ns.hugepages,
        )
    except ValueError as e:
        parser.error(str(e))
        return 2  # pragma: no cover - parser.error exits


if __name__ == "__main__":
    sys.exit(main())
