"""Multi-process start-up: one call that joins a process to a `jax.distributed` cluster.

`initialize()` wraps `jax.distributed.initialize`, the distributed engine this library builds on
(NCCL between GPU hosts, Gloo over TCP between CPU hosts). It reads the layout of the run from, in
order of precedence:

1. its arguments;
2. this library's environment variables, which ``python -m jax_bytegrad.launch`` sets for each
   process it starts:

   - ``JAX_BYTEGRAD_COORDINATOR``: ``host:port`` of process 0's coordinator service;
   - ``JAX_BYTEGRAD_NUM_PROCESSES``: number of processes in the run;
   - ``JAX_BYTEGRAD_PROCESS_ID``: this process's id, ``0 .. num_processes - 1``;
   - ``JAX_BYTEGRAD_CPU_DEVICES``: number of CPU devices this process exposes (CPU runs);
   - ``JAX_BYTEGRAD_RESTART``: how many times the launcher has restarted the run
     (`restart_count`);
   - ``JAX_BYTEGRAD_PROGRESS_FILE``: the file `report_progress` touches for the launcher's
     ``--progress-timeout``;
   - ``JAX_BYTEGRAD_FAIL_FAST`` and ``JAX_BYTEGRAD_QUIET``: ``1`` turns on `initialize`'s
     ``fail_fast`` and ``quiet`` where the call leaves them unset, ``0`` (or unset) leaves them
     off;

3. a SLURM (``srun``) or Open MPI (``mpirun``) job, through JAX's own cluster auto-detection.

With none of them the process runs alone, and `initialize()` changes nothing but the CPU device
count, if one was asked for.

`initialize()` changes nothing process-wide beyond JAX's own configuration unless asked to: the
exception hook (``fail_fast``) and native stdout (``quiet``) are the launcher's to turn on, for
its workers, as are the XLA:CPU thread pool's size (``NPROC``, see `ensure_cpu_threads`) and
glibc's huge pages, which only the environment a process starts with can turn on: a CPU process
that joins a run without them is told, once, what to set.

References:
  - JAX multi-process guide: https://docs.jax.dev/en/latest/multi_process.html
  - Gloo collective communications library: https://github.com/pytorch/gloo
"""

from __future__ import annotations

import os
import socket
import sys
import time
import warnings
from collections.abc import MutableMapping, Sequence
from typing import NamedTuple

import jax

from jax_bytegrad._src import checks
from jax_bytegrad._src.runtime import hugepages

COORDINATOR_ENV = "JAX_BYTEGRAD_COORDINATOR"
NUM_PROCESSES_ENV = "JAX_BYTEGRAD_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_BYTEGRAD_PROCESS_ID"
CPU_DEVICES_ENV = "JAX_BYTEGRAD_CPU_DEVICES"
RESTART_ENV = "JAX_BYTEGRAD_RESTART"
PROGRESS_FILE_ENV = "JAX_BYTEGRAD_PROGRESS_FILE"
FAIL_FAST_ENV = "JAX_BYTEGRAD_FAIL_FAST"
QUIET_ENV = "JAX_BYTEGRAD_QUIET"
# jax.distributed.initialize's default (JAX 0.10.2 to 0.12).
DEFAULT_HEARTBEAT_TIMEOUT = 100

# The variables whose presence makes JAX's SLURM and Open MPI detectors step in. JAX derives
# the coordinator from them; the process count and id are the schedulers' documented variables
# named last in each tuple.
_SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_NODELIST",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_PROCID",
)
_OMPI_VARS = ("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")


# Private helpers ----------------------------------------------------------------------------------


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(
            f"initialize: environment variable {name}={raw!r} is not an integer; "
            "set it to a whole number or unset it"
        ) from None


def _env_str(name: str) -> str | None:
    return os.environ.get(name, "").strip() or None


def _env_flag(name: str) -> bool:
    raw = os.environ.get(name, "").strip()
    if raw not in ("", "0", "1"):
        raise ValueError(
            f"initialize: environment variable {name}={raw!r} is not 0 or 1; set 1 to turn it "
            "on, 0 or nothing to leave it off"
        )
    return raw == "1"


class _Cluster(NamedTuple):
    """A scheduler's job as JAX's cluster detection reads it."""

    method: str  # JAX's cluster_detection_method
    num_processes: int
    process_id: int


def _detect_cluster() -> _Cluster | None:
    """The SLURM (srun) or Open MPI (mpirun) job this process runs in, if any."""
    for method, names in (("slurm", _SLURM_VARS), ("ompi", _OMPI_VARS)):
        if all(_env_str(name) for name in names):
            return _Cluster(method, _env_int(names[-2]), _env_int(names[-1]))
    return None


def _backend_started() -> bool:
    """Whether a JAX backend has started in this process, asked through public JAX alone.

    JAX refuses, with a RuntimeError, to change a setting read at backend start once a backend
    runs. The setting changed here is how long a CPU process waits for its peers' topology,
    which nothing in this library sets; when the change goes through it is undone at once.
    """
    name = "jax_cpu_get_local_topology_timeout_minutes"
    try:
        current = getattr(jax.config, name)
        jax.config.update(name, current + 1)
    except RuntimeError:
        return True
    except AttributeError:  # pragma: no cover - gone in a later JAX
        return False  # jax.distributed.initialize makes the same check itself
    jax.config.update(name, current)
    return False


def ensure_cpu_threads(cpu_devices: int, environ: MutableMapping[str, str] | None = None) -> None:
    """Gives XLA:CPU enough threads for ``cpu_devices`` devices that run collectives.

    XLA:CPU sizes the one thread pool that both launches each device's program and runs
    its independent ops concurrently as max(cores, devices). A program with two
    independent collectives can hold two threads per device while the devices still
    waiting to launch hold none: on a 2-core host with 8 devices that is a deadlock,
    which XLA ends after 40 s by aborting the process. XLA reads the pool size from
    ``NPROC``, when the CPU backend starts; this sets it to 4x the device count (or the
    core count, if more), unless it is already set.

    ``python -m jax_bytegrad.launch`` sets it for its workers; `initialize` does not. Call it
    yourself, before the backend starts, in a process that simulates more CPU devices than
    the host has cores and was not started by the launcher.

    Args:
      cpu_devices: CPU devices the process will expose.
      environ: The environment to set ``NPROC`` in, e.g. that of processes yet to start;
        None for this process's own (``os.environ``).

    Examples:
      >>> from jax_bytegrad.distributed import ensure_cpu_threads
      >>> env = {}
      >>> ensure_cpu_threads(8, env)
      >>> int(env["NPROC"]) >= 32
      True
      >>> env = {"NPROC": "16"}
      >>> ensure_cpu_threads(8, env)  # a value already set is left alone
      >>> env
      {'NPROC': '16'}
    """
    environ = os.environ if environ is None else environ
    environ.setdefault("NPROC", str(max(4 * cpu_devices, os.cpu_count() or 1)))


def _configure_cpu(cpu_devices: int | None) -> None:
    """Selects Gloo for cross-process CPU collectives and sets the CPU device count.

    Both are read once, when the CPU backend starts.
    """
    if getattr(jax.config, "jax_cpu_collectives_implementation", None) in (None, "none", ""):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if cpu_devices is not None and getattr(jax.config, "jax_num_cpu_devices", -1) != cpu_devices:
        try:
            jax.config.update("jax_num_cpu_devices", cpu_devices)
        except RuntimeError as e:  # JAX refuses once the backend has started
            raise RuntimeError(
                f"initialize: cannot set {cpu_devices} CPU devices, the JAX backend has already "
                "started; call jax_bytegrad.initialize() before any JAX computation or "
                "jax.devices() call"
            ) from e


def _install_fail_fast() -> None:
    """Makes an uncaught exception end the process at once instead of hanging at exit.

    At interpreter exit `jax.distributed` waits, up to its shutdown timeout of minutes, for every
    other process to shut down too, while they wait in a collective for the failed one: the run
    deadlocks and the failure never reaches the launcher or the scheduler. So after printing the
    traceback, exit with status 1.
    """
    previous = sys.excepthook
    if getattr(previous, "_jax_bytegrad_fail_fast", False):
        return

    def hook(exc_type, exc, tb):
        try:
            previous(exc_type, exc, tb)
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001 - a closed stream must not stop the exit
                    pass
            os._exit(130 if issubclass(exc_type, KeyboardInterrupt) else 1)

    hook._jax_bytegrad_fail_fast = True
    sys.excepthook = hook


def _quiet_native_stdout() -> None:
    """Drops what native code prints to stdout in this process; Python's own prints still show.

    Gloo prints a line per connection on every process ("[Gloo] Rank 1 is connected to 3
    peer ranks"), straight to file descriptor 1, so under the launcher every rank's lines
    interleave. Python's ``sys.stdout`` moves to a copy of the descriptor, and descriptor 1
    itself to /dev/null. stderr (errors, tracebacks) is left alone.
    """
    try:
        sys.stdout.flush()
        if sys.stdout.fileno() != 1:
            return  # already redirected (a test harness, a notebook): leave it be
    except (AttributeError, OSError, ValueError):
        return
    keep = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = os.fdopen(keep, "w", buffering=1)


def _advise_hugepages() -> None:
    """Warns, once, a CPU process that runs without glibc's huge pages where they would help."""
    message = hugepages.process_advice(getattr(jax.config, "jax_platforms", None))
    if message is not None:
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _resolve_layout(coordinator_address, num_processes, process_id, cpu_devices):
    """The layout asked for, arguments over ``JAX_BYTEGRAD_*`` variables, range-checked."""
    coord = coordinator_address if coordinator_address is not None else _env_str(COORDINATOR_ENV)
    nproc = num_processes if num_processes is not None else _env_int(NUM_PROCESSES_ENV)
    pid = process_id if process_id is not None else _env_int(PROCESS_ID_ENV)
    ncpu = cpu_devices if cpu_devices is not None else _env_int(CPU_DEVICES_ENV)
    if ncpu is not None and ncpu < 1:
        raise ValueError(f"initialize: cpu_devices={ncpu} must be at least 1 ({CPU_DEVICES_ENV})")
    if nproc is not None and nproc < 1:
        raise ValueError(
            f"initialize: num_processes={nproc} must be at least 1 ({NUM_PROCESSES_ENV})"
        )
    if pid is not None and nproc is not None and not 0 <= pid < nproc:
        raise ValueError(
            f"initialize: process_id={pid} is outside 0..{nproc - 1} for num_processes={nproc}"
        )
    return coord, nproc, pid, ncpu


def _previous_result(key: tuple, asks_nothing: bool) -> DistributedInfo:
    """A repeated call's answer: the first result, unless it asks for another layout."""
    if key == _STATE_KEY or asks_nothing:
        return _STATE
    coord, nproc, pid, _, ncpu = key
    raise RuntimeError(
        f"initialize: already initialized as {_STATE}; a second call asked for "
        f"coordinator={coord!r}, num_processes={nproc}, process_id={pid}, cpu_devices={ncpu}. "
        "Call it once per process."
    )


def _single_process(ncpu: int | None) -> DistributedInfo:
    """Starts or reconfigures nothing beyond the asked-for device count."""
    if ncpu is not None:
        _configure_cpu(ncpu)
    if jax.distributed.is_initialized():  # jax.distributed.initialize was called directly
        return DistributedInfo(jax.process_index(), jax.process_count(), None, "jax.distributed")
    return DistributedInfo(0, 1, None, "single")


def _await_coordinator(address: str, timeout: float) -> float:
    """Waits until ``address`` (``host:port``) accepts TCP connections, at most ``timeout``
    seconds; returns the seconds left of it.

    A process that asks process 0's coordinator before it listens is refused, and JAX's
    client (gRPC) then retries after exponentially growing pauses (1 s, 1.6 s, 2.6 s, ... up
    to 120 s): started 30 s before the coordinator here, it joined 14 s after the coordinator
    was up. Asking every 50 ms first, it joins as soon as the coordinator listens.
    """
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                break
        except OSError:
            if time.monotonic() >= deadline:
                break  # JAX's own connect then fails with its error
            time.sleep(0.05)
    return max(1.0, deadline - time.monotonic())


def _check_can_join(given: dict, cluster) -> list[str]:
    """Raises unless this process can join a run; returns the fields left to the detector."""
    missing = [name for name, v in given.items() if v is None]
    if missing and cluster is None:
        env_names = {
            "coordinator_address": COORDINATOR_ENV,
            "num_processes": NUM_PROCESSES_ENV,
            "process_id": PROCESS_ID_ENV,
        }
        got = ", ".join(f"{k}={v!r}" for k, v in given.items() if v is not None)
        raise ValueError(
            f"initialize: got {got} but not {', '.join(missing)}; pass them, or set "
            f"{', '.join(env_names[m] for m in missing)}, or run under srun / mpirun"
        )
    if jax.distributed.is_initialized():
        raise RuntimeError(
            "initialize: jax.distributed.initialize was already called in this process; call "
            "jax_bytegrad.initialize() instead of it, not as well"
        )
    if _backend_started():
        raise RuntimeError(
            "initialize: the JAX backend has already started in this process, so it cannot join "
            "a multi-process run; call jax_bytegrad.initialize() first, before any JAX "
            "computation or jax.devices() call"
        )
    return missing


# State --------------------------------------------------------------------------------------------


class DistributedInfo(NamedTuple):
    """Where this process sits in the run, as `initialize()` resolved it.

    Attributes:
      process_id: This process's id, ``0 .. num_processes - 1``.
      num_processes: Number of processes in the run; 1 for a single process.
      coordinator_address: ``host:port`` of process 0's coordinator, as passed or set in
        ``JAX_BYTEGRAD_COORDINATOR``; None for a single process, and where JAX derived it
        from a SLURM or Open MPI job (JAX has no public way to read it back).
      source: Where the layout came from: ``"arguments"``, ``"environment"``
        (``JAX_BYTEGRAD_*``), ``"slurm"``, ``"ompi"``, ``"single"`` (nothing set: one process,
        no `jax.distributed`) or ``"jax.distributed"`` (it was initialized directly before).
    """

    process_id: int
    num_processes: int
    coordinator_address: str | None
    source: str


_STATE: DistributedInfo | None = None
_STATE_KEY: tuple | None = None


# Public API ---------------------------------------------------------------------------------------


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    cpu_devices: int | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int = DEFAULT_HEARTBEAT_TIMEOUT,
    fail_fast: bool | None = None,
    quiet: bool | None = None,
) -> DistributedInfo:
    """Joins this process to a multi-process JAX run, or does nothing for a single process.

    Call it once, first thing, before any JAX computation or ``jax.devices()``: the CPU device
    count and the collectives implementation are fixed when the backend starts. Arguments override
    the ``JAX_BYTEGRAD_*`` environment variables field by field; with neither, JAX detects a SLURM
    or Open MPI job; with none of them the process runs alone. On CPU, cross-process collectives
    go over Gloo (GPUs use NCCL and need nothing here).

    A repeated call returns the first result; one asking for a different layout raises.

    Besides JAX's configuration it changes nothing in the process unless asked: ``fail_fast``
    and ``quiet`` are off unless passed, or turned on by ``JAX_BYTEGRAD_FAIL_FAST=1`` and
    ``JAX_BYTEGRAD_QUIET=1``, which ``python -m jax_bytegrad.launch`` sets for its workers.
    Under ``srun`` or ``mpirun``, pass ``fail_fast=True`` (or export the variable) so that a
    failed process ends the job instead of hanging it. A process that simulates more CPU
    devices than its host has cores also needs `ensure_cpu_threads` (the launcher sees to it).

    CPU workers should run with glibc's large allocations on transparent huge pages
    (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``): XLA:CPU allocates gradient-size buffers afresh
    every step, and on 4 KiB pages their page faults take much of a compressed sync's CPU time.
    glibc reads that setting only when a process starts, so this function cannot turn it on;
    ``python -m jax_bytegrad.launch`` does by default, and under ``srun`` or ``mpirun`` export
    it in the job's environment. A process that joins a multi-process run on the CPU without it
    gets a `RuntimeWarning` saying so, once, where it would help: glibc >= 2.35 and its malloc
    in use, and the kernel's transparent huge pages in ``madvise`` mode. Setting
    ``glibc.malloc.hugetlb=0`` keeps 4 KiB pages without the warning.

    A process that stops sending heartbeats to the coordination service (dead, stopped, or cut
    off by a network partition) for ``heartbeat_timeout_seconds`` ends the whole run: the
    service reports it to the other processes, and each aborts (SIGABRT, with a C++ stack
    trace). A partition shorter than the timeout is ridden out. Restarting from a checkpoint
    after such an abort is the launcher's (``--max-restarts``) or the job script's; see
    docs/elastic.md.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator service.
        Env: ``JAX_BYTEGRAD_COORDINATOR``.
      num_processes: Number of processes. Env: ``JAX_BYTEGRAD_NUM_PROCESSES``.
      process_id: This process's id, ``0 .. num_processes - 1``. Env: ``JAX_BYTEGRAD_PROCESS_ID``.
      local_device_ids: The accelerators this process uses (GPU runs), as in
        `jax.distributed.initialize`.
      cpu_devices: Number of CPU devices this process exposes. Env: ``JAX_BYTEGRAD_CPU_DEVICES``.
        None keeps JAX's default (one, or ``--xla_force_host_platform_device_count``).
      initialization_timeout: Seconds to wait for every process to reach the coordinator. A
        process other than 0 first waits, within it, until the coordinator accepts connections
        (asking every 50 ms), so that it joins as soon as process 0 is up.
      heartbeat_timeout_seconds: Seconds without a heartbeat after which the coordination
        service declares a process dead and aborts every process of the run; JAX's default is
        100. Longer rides out longer network partitions, and takes as long to notice a host
        that died without closing its connections (power loss, kernel panic).
      fail_fast: In a multi-process run, replace ``sys.excepthook`` so that an uncaught
        exception prints its traceback and exits the process with status 1 at once. Otherwise
        the process hangs at exit in `jax.distributed`'s shutdown barrier while the others wait
        for it in a collective, and no launcher or scheduler learns of the failure. None: as
        ``JAX_BYTEGRAD_FAIL_FAST`` says (off if unset).
      quiet: In a multi-process run, on every process but 0, send native stdout (file
        descriptor 1) to /dev/null and Python's ``sys.stdout`` to a copy of it: what native
        libraries print (Gloo's connection lines, one per peer and collective group) then shows
        only for process 0, while Python's own ``print`` and everything on stderr still show.
        None: as ``JAX_BYTEGRAD_QUIET`` says (off if unset).

    Returns:
      A `DistributedInfo`: this process's id, the process count, the coordinator and the source.

    Raises:
      ValueError: The layout is only partly given (say a coordinator but no process id) and no
        SLURM or Open MPI job fills the gap; a number (a timeout included) is not a whole
        number in range; or an environment variable is not an integer
        (``JAX_BYTEGRAD_FAIL_FAST`` and ``JAX_BYTEGRAD_QUIET``: not 0 or 1).
      RuntimeError: It was called after the JAX backend started, or again with another layout.

    Examples:
      Alone, with nothing set, it is a no-op that reports one process:

      >>> import jax_bytegrad
      >>> jax_bytegrad.initialize()  # doctest: +SKIP
      DistributedInfo(process_id=0, num_processes=1, coordinator_address=None, source='single')

      Process 0 of two on one machine, by hand (``python -m jax_bytegrad.launch --nproc 2
      train.py`` does this through the environment):

      >>> jax_bytegrad.initialize("127.0.0.1:12345", 2, 0, cpu_devices=4)  # doctest: +SKIP

    References:
      - JAX multi-process guide: https://docs.jax.dev/en/latest/multi_process.html
    """
    global _STATE, _STATE_KEY

    checks.integer(initialization_timeout, "initialization_timeout", "initialize", why=" seconds")
    checks.integer(
        heartbeat_timeout_seconds,
        "heartbeat_timeout_seconds",
        "initialize",
        why=f" seconds (JAX's default: {DEFAULT_HEARTBEAT_TIMEOUT})",
    )
    from_args = any(v is not None for v in (coordinator_address, num_processes, process_id))
    coord, nproc, pid, ncpu = _resolve_layout(
        coordinator_address, num_processes, process_id, cpu_devices
    )
    devices = tuple(local_device_ids) if local_device_ids is not None else None
    key = (coord, nproc, pid, devices, ncpu)
    if _STATE is not None:
        asks_nothing = not from_args and local_device_ids is None and cpu_devices is None
        return _previous_result(key, asks_nothing)

    given = {"coordinator_address": coord, "num_processes": nproc, "process_id": pid}
    fail_fast = _env_flag(FAIL_FAST_ENV) if fail_fast is None else fail_fast
    quiet = _env_flag(QUIET_ENV) if quiet is None else quiet
    cluster = _detect_cluster()
    if all(v is None for v in given.values()) and (cluster is None or cluster.num_processes <= 1):
        info = _single_process(ncpu)
    else:
        missing = _check_can_join(given, cluster)
        _configure_cpu(ncpu)
        if fail_fast:
            _install_fail_fast()  # before joining: a peer that never comes is a failure too
        if missing:  # JAX's detector fills the gaps from the SLURM / Open MPI variables
            method, source = cluster.method, cluster.method
            nproc = cluster.num_processes if nproc is None else nproc
            pid = cluster.process_id if pid is None else pid
        else:
            method, source = "deactivate", ("arguments" if from_args else "environment")
        timeout = initialization_timeout
        if coord is not None and pid != 0:
            timeout = int(_await_coordinator(coord, initialization_timeout))
        jax.distributed.initialize(
            coordinator_address=coord,
            num_processes=given["num_processes"],
            process_id=given["process_id"],
            local_device_ids=local_device_ids,
            cluster_detection_method=method,
            initialization_timeout=timeout,
            heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        )
        info = DistributedInfo(pid, nproc, coord, source)
        if quiet and info.process_id != 0:
            _quiet_native_stdout()  # Gloo connects at the first collective, after this
        if info.num_processes > 1:
            _advise_hugepages()
    _STATE, _STATE_KEY = info, key
    return info


def restart_count() -> int:
    """How many times ``python -m jax_bytegrad.launch --max-restarts`` has restarted this run.

    0 on the first attempt, and outside the launcher. A script resumes from its checkpoint
    either way (`jax_bytegrad.checkpoint.Checkpointer.restore_or_init`); this is for its logs,
    or for a test that fails on purpose only on the first attempt.

    Returns:
      The value of ``JAX_BYTEGRAD_RESTART``, or 0 if it is unset.

    Raises:
      ValueError: ``JAX_BYTEGRAD_RESTART`` is set but not a whole number >= 0.

    Examples:
      >>> from jax_bytegrad.distributed import restart_count
      >>> restart_count()  # doctest: +SKIP
      0
    """
    value = _env_int(RESTART_ENV)
    if value is not None and value < 0:
        raise ValueError(f"restart_count: {RESTART_ENV}={value} must be >= 0; unset it")
    return value or 0


def report_progress(step: int) -> None:
    """Tells the launcher that this process finished `step`, so it is not hung.

    Under ``python -m jax_bytegrad.launch --progress-timeout S`` a process that goes S seconds
    without this call counts as hung and the run is stopped (and restarted, with
    ``--max-restarts``). Call it once per step, after something that waits for the step (a
    loss read back to the host), not just after dispatching it. It writes the step number to
    ``JAX_BYTEGRAD_PROGRESS_FILE`` (a few bytes, local disk); outside the launcher it does
    nothing.

    Args:
      step: The step just finished; shown in the launcher's message if the run hangs.

    Examples:
      >>> from jax_bytegrad.distributed import report_progress
      >>> report_progress(0)  # a no-op outside the launcher
    """
    path = _env_str(PROGRESS_FILE_ENV)
    if path is not None:
        with open(path, "w") as f:
            f.write(f"{int(step)}\n")
