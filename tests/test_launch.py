"""Tests for jax_bytegrad.initialize() and `python -m jax_bytegrad.launch`.

The multi-process tests start real processes that talk Gloo over TCP on 127.0.0.1.
"""

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import pytest
from conftest import requires_gloo
from helpers import REPO, processes_with, run_launcher

import jax_bytegrad
from jax_bytegrad import distributed

# initialize()'s record of this process's run, which the tests reset and read: no public form.
from jax_bytegrad._src.runtime import cluster as run_record
from jax_bytegrad._src.runtime import launcher
from jax_bytegrad.launch import launch, main

SCRIPTS = Path(__file__).parent / "_mp_scripts"


_LAYOUT_VARS = (
    distributed.COORDINATOR_ENV,
    distributed.NUM_PROCESSES_ENV,
    distributed.PROCESS_ID_ENV,
    distributed.CPU_DEVICES_ENV,
    distributed.FAIL_FAST_ENV,
    distributed.QUIET_ENV,
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "OMPI_MCA_orte_hnp_uri",
)

# Hang guards only: a run that needs them has failed. Generous, so that a loaded machine is slow
# but never wrong.
HANG_GUARD = 300


def _run_launcher(*args: str, env: dict | None = None) -> tuple[int, str]:
    return run_launcher(*args, env=env, timeout=HANG_GUARD)


def _run_main(capfd, *args: str) -> tuple[int, str]:
    """The command line ``python -m jax_bytegrad.launch ARGS`` run in this process: the same
    `main`, without a new Python importing JAX for it (about 2.5 s of CPU; the Gloo tests below
    run the real ``python -m``). Its exit code and output, stdout and stderr together."""
    capfd.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # a usage error, from argparse
        code = e.code
    captured = capfd.readouterr()
    return code, captured.out + captured.err


@pytest.fixture
def clean_state(monkeypatch):
    for name in _LAYOUT_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(run_record, "_STATE", None)
    monkeypatch.setattr(run_record, "_STATE_KEY", None)


# initialize() in this process ---------------------------------------------------------------------


def test_initialize_with_nothing_set_is_a_single_process_no_op(clean_state):
    info = jax_bytegrad.initialize()
    assert info == distributed.DistributedInfo(0, 1, None, "single")
    assert not jax.distributed.is_initialized()
    assert jax.process_count() == 1
    assert jax_bytegrad.initialize() is info  # idempotent


def test_initialize_partial_layout_names_what_is_missing(clean_state, monkeypatch):
    monkeypatch.setenv(distributed.COORDINATOR_ENV, "127.0.0.1:1234")
    with pytest.raises(ValueError, match="JAX_BYTEGRAD_NUM_PROCESSES.*JAX_BYTEGRAD_PROCESS_ID"):
        jax_bytegrad.initialize()
    assert not jax.distributed.is_initialized()


@pytest.mark.parametrize(
    "env, match",
    [
        ({distributed.NUM_PROCESSES_ENV: "two"}, "is not an integer"),
        ({distributed.NUM_PROCESSES_ENV: "2", distributed.PROCESS_ID_ENV: "2"}, "outside 0..1"),
        ({distributed.CPU_DEVICES_ENV: "0"}, "at least 1"),
    ],
    ids=["not-an-int", "id-out-of-range", "zero-devices"],
)
def test_initialize_rejects_bad_values(clean_state, monkeypatch, env, match):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=match):
        jax_bytegrad.initialize()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"heartbeat_timeout_seconds": 0},
        {"heartbeat_timeout_seconds": 2.5},
        {"heartbeat_timeout_seconds": True},
        {"heartbeat_timeout_seconds": None},
        {"initialization_timeout": -1},
    ],
    ids=["zero", "fraction", "bool", "none", "negative-initialization"],
)
def test_initialize_rejects_a_timeout_that_is_not_whole_seconds(clean_state, kwargs):
    # Checked first, before the layout: a single process with a bad timeout is refused too.
    ((name, value),) = kwargs.items()
    with pytest.raises(
        ValueError, match=f"initialize: {name} must be an int >= 1 seconds.*{value}"
    ):
        jax_bytegrad.initialize(**kwargs)
    assert run_record._STATE is None


def test_initialize_after_backend_start_refuses_a_multi_process_layout(clean_state):
    jax.devices()  # the backend is running in this test process
    with pytest.raises(RuntimeError, match="before any JAX computation"):
        jax_bytegrad.initialize("127.0.0.1:1", num_processes=2, process_id=0)


def test_a_process_joins_as_soon_as_the_coordinator_listens():
    # JAX's client, refused by a coordinator not yet up, retries after growing pauses (14 s
    # late, measured, for a coordinator up 30 s after it): initialize asks every 50 ms first.
    listening = threading.Event()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{server.getsockname()[1]}"

        def listen_later():
            time.sleep(2.0)
            server.listen()
            listening.set()

        threading.Thread(target=listen_later, daemon=True).start()
        start = time.monotonic()
        left = run_record._await_coordinator(address, timeout=60)
        waited = time.monotonic() - start
    assert listening.is_set()
    assert 2.0 <= waited < 30, waited  # it waited for the listener, not for its deadline
    assert 30 < left <= 58, left  # what is left of the timeout goes to JAX's own connect


def test_a_coordinator_that_never_listens_leaves_the_error_to_jax_after_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        address = f"127.0.0.1:{s.getsockname()[1]}"
        start = time.monotonic()
        left = run_record._await_coordinator(address, timeout=1)
        assert 1.0 <= time.monotonic() - start < 10
    assert left == 1.0  # JAX's initialize then fails on its own, after at least a second


def _subprocess_env(**extra: str) -> dict:
    """This environment without any layout, process-wide setting or device count, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in (*_LAYOUT_VARS, "NPROC", "XLA_FLAGS")}
    env.update({"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO), **extra})
    return env


def test_initialize_single_process_sets_cpu_device_count():
    code = textwrap.dedent(
        """
        import jax_bytegrad
        import jax_bytegrad._src.runtime.cluster as d
        import jax
        timeout = jax.config.jax_cpu_get_local_topology_timeout_minutes
        before = d._backend_started()
        info = jax_bytegrad.initialize()
        print(info.source, jax.local_device_count(), jax.config.jax_cpu_collectives_implementation)
        after = d._backend_started()
        print(before, after, jax.config.jax_cpu_get_local_topology_timeout_minutes == timeout)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_subprocess_env(**{distributed.CPU_DEVICES_ENV: "3"}),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        check=True,
    )
    # The probe for a started backend leaves the setting it tries as it was.
    assert out.stdout.split()[-6:] == ["single", "3", "gloo", "False", "True", "True"]


_PROCESS_WIDE = """
import os, sys
import jax_bytegrad
hook, stdout_fd = sys.excepthook, sys.stdout.fileno()
info = jax_bytegrad.initialize("127.0.0.1:{port}", 1, 0{kwargs})  # one process, through Gloo
print(info.source, sys.excepthook is not hook, "NPROC" in os.environ, sys.stdout.fileno() == 1)
sys.stdout.flush()
raise RuntimeError(f"exiting {{info.process_id}}")  # through the hook, if it was replaced
"""


@pytest.mark.parametrize(
    "kwargs, env, hook_replaced",
    [
        ("", {}, False),
        ("", {distributed.FAIL_FAST_ENV: "1"}, True),
        (", fail_fast=True", {}, True),
        (", fail_fast=False", {distributed.FAIL_FAST_ENV: "1"}, False),
    ],
    ids=["default-changes-nothing", "env-turns-on", "argument-turns-on", "argument-wins"],
)
def test_initialize_changes_process_wide_state_only_when_asked(kwargs, env, hook_replaced):
    from jax_bytegrad._src import checks

    code = _PROCESS_WIDE.format(port=checks.free_port(), kwargs=kwargs)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=_subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert out.returncode == 1 and "RuntimeError: exiting 0" in out.stderr, out.stderr
    assert out.stdout.split()[-4:] == ["arguments", str(hook_replaced), "False", "True"]


def test_initialize_rejects_a_flag_variable_that_is_not_0_or_1(clean_state, monkeypatch):
    monkeypatch.setenv(distributed.QUIET_ENV, "yes")
    with pytest.raises(ValueError, match="JAX_BYTEGRAD_QUIET='yes' is not 0 or 1"):
        jax_bytegrad.initialize()


# The launcher alone (no JAX in the children) ------------------------------------------------------


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_launch_sets_the_environment_and_prefixes_output(tmp_path):
    out_file = tmp_path / "out"
    with out_file.open("wb") as out:
        code = launch(
            _py(
                """
                import os
                e = os.environ
                print(e["JAX_BYTEGRAD_PROCESS_ID"], e["JAX_BYTEGRAD_NUM_PROCESSES"],
                      e["JAX_BYTEGRAD_CPU_DEVICES"], e["JAX_BYTEGRAD_COORDINATOR"])
                """
            ),
            nproc=3,
            devices_per_proc=2,
            port=23456,
            out=out,
        )
    assert code == 0
    lines = sorted(out_file.read_text().splitlines())
    assert lines == [f"[rank {k}] {k} 3 2 127.0.0.1:23456" for k in range(3)]


GLOO_LINE = (
    "[Gloo] Rank {} is connected to {} peer ranks. Expected number of connected peer ranks is : 3"
)


# Four reports of Gloo's threads torn into each other on rank 1 of a 2 x 4 run (their counts are
# 7: one rank's eight devices), as the launcher received them (JAX 0.10.2).
GLOO_TORN_BURST = [
    "[Gloo] Rank [Gloo] Rank 5 is connected to 7 peer ranks. Expected number of connected peer "
    "ranks is : [Gloo] Rank 7 is connected to [Gloo] Rank 6 is connected to 7 peer ranks. "
    "Expected number of connected peer ranks is : 74 is connected to 7 peer ranks. 7 peer ranks. ",
    "Expected number of connected peer ranks is : 7",
    "Expected number of connected peer ranks is : 7",
    "7",
]


@pytest.mark.parametrize("quiet", [None, "0"], ids=["launcher-default", "quiet-off"])
def test_launch_leaves_out_gloo_connection_lines_unless_told(tmp_path, quiet):
    env = {k: v for k, v in os.environ.items() if k not in _LAYOUT_VARS}
    if quiet is not None:
        env[distributed.QUIET_ENV] = quiet
    # Gloo's threads print unlocked: pieces of two lines can share one (seen at 2 x 4).
    torn = ["[Gloo] Rank " + GLOO_LINE.format(0, 3), GLOO_LINE.format(1, 3).split("Rank ")[1]]
    other = "Rank 1 is connected to the database"
    lines = [
        GLOO_LINE.format(0, 3),
        "step 1",
        "7",  # the script's own: no torn report is open
        *torn,
        other,
        *GLOO_TORN_BURST,
        "",  # the script's own empty line, after the burst has ended
        "7",
        GLOO_LINE.format(2, 2),
    ]
    out_file = tmp_path / "out"
    with out_file.open("wb") as out:
        code = launch(_py(f"print({chr(10).join(lines)!r})"), nproc=2, env=env, out=out)
    assert code == 0
    got = out_file.read_text().splitlines()
    for rank in (0, 1):
        mine = [line.removeprefix(f"[rank {rank}] ") for line in got if f"[rank {rank}]" in line]
        # A rank that connected to fewer peers than expected is news: that line always stays.
        kept = ["step 1", "7", other, "", "7", GLOO_LINE.format(2, 2)]
        expected = lines if quiet == "0" else kept
        assert mine == expected, got


def test_a_sigterm_echo_is_left_out_only_when_the_launcher_sent_it():
    from jax_bytegrad._src.runtime.worker_output import NoiseFilter

    # JAX 0.10.2 logs it from preemption_notifier.cc:90, JAX 0.12 from line 94.
    echo = b"W1125 18:15:47.007277    4272 preemption_notifier.cc:94] SIGTERM caught at 2026\n"
    stopping = threading.Event()
    noise = NoiseFilter(stopping)
    assert not noise.is_noise(echo)  # a SIGTERM from elsewhere: kept
    stopping.set()
    assert noise.is_noise(echo)
    assert not noise.is_noise(b"SIGTERM caught by my own handler\n")


def test_the_first_process_to_end_is_the_one_named(tmp_path):
    # Rank 1 dies by SIGKILL; rank 0 sees it dead, then fails as the peer of a dead process
    # does (a collective's connection reset). Both may have ended by the launcher's next look;
    # the one to blame is the first to end, rank 1, not the lowest rank.
    pid_file = tmp_path / "rank1.pid"
    with (tmp_path / "out").open("wb") as out:
        code = launch(
            _py(
                f"""
                import os, signal, time
                from pathlib import Path
                pid_file = Path({str(pid_file)!r})
                if os.environ["JAX_BYTEGRAD_PROCESS_ID"] == "1":
                    pid_file.write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
                while not pid_file.exists():
                    time.sleep(0.01)
                stat = Path(f"/proc/{{pid_file.read_text()}}/stat")
                while True:  # until it is dead: a zombie, or reaped
                    try:
                        if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                            break
                    except OSError:
                        break
                    time.sleep(0.001)
                print("rank 0: my peer is gone", flush=True)
                os._exit(1)
                """
            ),
            nproc=2,
            out=out,
        )
    text = (tmp_path / "out").read_text()
    assert code == 128 + 9, text
    assert "[launch] rank 1 was killed by signal 9; stopped all 2 processes" in text, text


def test_the_blame_waits_for_every_ended_process_and_puts_a_signal_first():
    # Under load the exit threads run in any order: rank 0's error exit is appended first, and
    # rank 1 (SIGKILLed, its thread not yet run) a moment later.
    attempt = launcher._Attempt()
    attempt.procs = [subprocess.Popen(["true"]), subprocess.Popen(["sleep", "60"])]
    attempt.procs[1].kill()
    while not launcher._ended(attempt.procs[1]):
        time.sleep(0.01)
    attempt.exits.append((0, attempt.procs[0].wait()))
    late = threading.Timer(0.3, lambda: attempt.exits.append((1, attempt.procs[1].wait())))
    late.start()
    attempt.exits[0] = (0, 1)  # as a peer failing in a collective would exit
    assert launcher._blamed(attempt) == (1, -9)
    late.join()
    # Two error exits: the first appended.
    attempt.exits[:] = [(1, 3), (0, 1)]
    assert launcher._blamed(attempt) == (1, 3)


@pytest.mark.parametrize(
    "hugepages, base, expected",
    [
        (True, None, "glibc.malloc.hugetlb=1"),
        (True, "glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"),
        (True, "glibc.malloc.hugetlb=0", "glibc.malloc.hugetlb=0"),
        (False, None, "unset"),
    ],
    ids=["default-on", "keeps-other-tunables", "user-setting-wins", "turned-off"],
)
def test_launch_puts_cpu_workers_on_huge_pages(tmp_path, hugepages, base, expected):
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    if base is not None:
        env["GLIBC_TUNABLES"] = base
    out_file = tmp_path / "out"
    with out_file.open("wb") as out:
        code = launch(
            _py("import os; print(os.environ.get('GLIBC_TUNABLES', 'unset'))"),
            nproc=1,
            env=env,
            hugepages=hugepages,
            out=out,
        )
    assert code == 0
    assert out_file.read_text().splitlines() == [f"[rank 0] {expected}"]


@pytest.mark.parametrize(
    "base, expected",
    [
        ({}, ["1", "1", str(max(4 * 2, os.cpu_count()))]),
        (
            {distributed.FAIL_FAST_ENV: "0", distributed.QUIET_ENV: "0", "NPROC": "3"},
            ["0", "0", "3"],
        ),
    ],
    ids=["launcher-turns-on", "caller-wins"],
)
def test_launch_owns_the_process_wide_settings_of_its_workers(tmp_path, base, expected):
    env = {k: v for k, v in os.environ.items() if k not in (*_LAYOUT_VARS, "NPROC")}
    env.update(base)
    out_file = tmp_path / "out"
    with out_file.open("wb") as out:
        code = launch(
            _py(
                """
                import os
                e = os.environ
                print(e["JAX_BYTEGRAD_FAIL_FAST"], e["JAX_BYTEGRAD_QUIET"], e["NPROC"])
                """
            ),
            nproc=2,
            devices_per_proc=2,
            env=env,
            out=out,
        )
    assert code == 0
    assert sorted(out_file.read_text().splitlines()) == [
        f"[rank {k}] {' '.join(expected)}" for k in range(2)
    ]


def test_launcher_command_line_turns_huge_pages_off(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    script = tmp_path / "show.py"
    script.write_text("import os; print(os.environ.get('GLIBC_TUNABLES', 'unset'))\n")
    for flags, expected in (((), "glibc.malloc.hugetlb=1"), (("--no-hugepages",), "unset")):
        code, output = _run_main(capfd, "--nproc", "1", *flags, str(script))
        assert code == 0, output
        assert f"[rank 0] {expected}" in output.splitlines()


def test_launch_stops_the_others_when_one_fails(tmp_path):
    marker = f"marker-{os.getpid()}-{time.monotonic_ns()}"
    with (tmp_path / "out").open("wb") as out:
        code = launch(
            _py(
                """
                import os, signal, time
                if os.environ["JAX_BYTEGRAD_PROCESS_ID"] == "1":
                    time.sleep(0.5)
                    raise SystemExit(7)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # must still be stopped, by SIGKILL
                time.sleep(600)
                """
            )
            + [marker],
            nproc=3,
            grace=1.0,
            timeout=HANG_GUARD,  # 124, had the others been waited for rather than stopped
            out=out,
        )
    text = (tmp_path / "out").read_text()
    assert code == 7, text
    assert "[launch] rank 1 exited with code 7; stopped all 3 processes" in text
    assert processes_with(marker) == []


def test_launch_timeout(tmp_path):
    with (tmp_path / "out").open("wb") as out:
        code = launch(_py("import time; time.sleep(600)"), nproc=2, timeout=1.0, grace=1.0, out=out)
    assert code == 124


# Restarts and hangs (no JAX in the children) ------------------------------------------------------


def test_restart_count_and_report_progress(monkeypatch, tmp_path):
    monkeypatch.delenv(distributed.RESTART_ENV, raising=False)
    monkeypatch.delenv(distributed.PROGRESS_FILE_ENV, raising=False)
    assert distributed.restart_count() == 0
    distributed.report_progress(3)  # no launcher: nothing to do, nothing written
    monkeypatch.setenv(distributed.RESTART_ENV, "2")
    assert distributed.restart_count() == 2
    monkeypatch.setenv(distributed.RESTART_ENV, "-1")
    with pytest.raises(ValueError, match="JAX_BYTEGRAD_RESTART=-1"):
        distributed.restart_count()
    monkeypatch.setenv(distributed.PROGRESS_FILE_ENV, str(tmp_path / "rank0"))
    distributed.report_progress(7)
    assert (tmp_path / "rank0").read_text() == "7\n"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_restarts": -1}, "max_restarts must be an int >= 0 \\(0: no restart\\), got -1"),
        ({"max_restarts": 1.5}, "max_restarts must be an int >= 0 \\(0: no restart\\), got 1.5"),
        ({"progress_timeout": 0}, "progress_timeout=0"),
    ],
    ids=["negative-restarts", "fractional-restarts", "zero-progress-timeout"],
)
def test_launch_rejects_bad_restart_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(_py("pass"), nproc=1, **kwargs)


@pytest.mark.parametrize("what", ["missing", "directory"])
def test_a_script_that_cannot_be_run_is_a_usage_error_before_any_attempt(tmp_path, capfd, what):
    script = tmp_path / "train.py"
    if what == "directory":
        script.mkdir()
    code, output = _run_main(capfd, "--nproc", "2", "--max-restarts", "3", str(script))
    assert code == 2, output
    why = "does not exist" if what == "missing" else "is not a readable file"
    assert f"error: launch: script '{script}' {why}; pass the path" in output
    assert "[rank" not in output and "[launch]" not in output  # nothing was started


def test_an_exit_status_of_2_is_not_restarted(tmp_path):
    out_file = tmp_path / "out"
    with out_file.open("wb") as out:
        code = launch(
            _py(
                """
                import os, time
                print("attempt", os.environ["JAX_BYTEGRAD_RESTART"], flush=True)
                if os.environ["JAX_BYTEGRAD_PROCESS_ID"] == "1":
                    raise SystemExit(2)
                time.sleep(600)
                """
            ),
            nproc=2,
            grace=0.5,
            max_restarts=3,
            timeout=HANG_GUARD,
            out=out,
        )
    text = out_file.read_text()
    assert code == 2, text
    assert "[rank 1] attempt 0" in text and "attempt 1" not in text
    assert (
        "[launch] rank 1 exited with code 2, a usage error that no restart can cure; "
        "stopped all 2 processes; 0 of 3 restart(s) used" in text
    )


def test_a_script_given_bad_arguments_runs_once(tmp_path, capfd):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import argparse, os
            print("attempt", os.environ["JAX_BYTEGRAD_RESTART"], flush=True)
            argparse.ArgumentParser().parse_args()
            """
        )
    )
    code, output = _run_main(capfd, "--nproc", "2", "--max-restarts", "3", str(script), "--steps")
    assert code == 2, output
    assert "unrecognized arguments: --steps" in output
    assert "attempt 0" in output and "attempt 1" not in output
    assert "a usage error that no restart can cure" in output
    assert "0 of 3 restart(s) used" in output


def test_launcher_restarts_all_after_a_failure_and_tells_the_attempt(tmp_path, capfd):
    # Rank 1 fails on the first attempt only; rank 0 would run on forever if not stopped. The
    # attempt is read as restart_count() reads it (test_restart_count_and_report_progress), not
    # through it: importing JAX in four processes cost 10 s of CPU.
    script = tmp_path / "flaky.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            e = os.environ
            rank, attempt = e["JAX_BYTEGRAD_PROCESS_ID"], e["JAX_BYTEGRAD_RESTART"]
            print("attempt", attempt, flush=True)
            if attempt == "0":
                if rank == "1":
                    raise SystemExit(3)
                time.sleep(600)
            """
        )
    )
    code, output = _run_main(capfd, "--nproc", "2", "--max-restarts", "2", str(script))
    assert code == 0, output
    # Rank 0 may be stopped before it prints on the first attempt; rank 1 prints, then fails.
    assert "[rank 1] attempt 0" in output
    for rank in (0, 1):
        assert f"[rank {rank}] attempt 1" in output
        assert f"[rank {rank}] attempt 2" not in output
    assert "[launch] rank 1 exited with code 3; stopped all 2 processes; restart 1 of 2" in output
    assert "[launch] all 2 processes exited 0; 1 of 2 restart(s) used" in output


def test_out_of_restarts_exits_non_zero_and_leaves_no_process(tmp_path):
    marker = f"marker-{os.getpid()}-{time.monotonic_ns()}"
    out_file = tmp_path / "out"
    with out_file.open("wb") as out:
        code = launch(
            _py(
                """
                import os, signal, sys, time
                if os.environ["JAX_BYTEGRAD_PROCESS_ID"] == "1":
                    time.sleep(0.3)
                    os.kill(os.getpid(), signal.SIGKILL)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)  # must still go, by SIGKILL
                time.sleep(600)
                """
            )
            + [marker],
            nproc=2,
            grace=0.5,
            max_restarts=1,
            out=out,
        )
    text = out_file.read_text()
    assert code == 128 + 9, text
    assert text.count("rank 1 was killed by signal 9") == 2, text
    assert "restart 1 of 1" in text
    assert (
        "[launch] out of restarts: rank 1 was killed by signal 9; 1 of 1 restart(s) used; "
        "exiting with 137" in text
    )
    assert processes_with(marker) == []


def test_a_process_without_progress_is_restarted(tmp_path):
    # On the first attempt rank 1 reports steps 0..3, then stops reporting (a hang), while rank 0
    # reports its steps and exits 0. The children write the progress file as report_progress
    # does, without importing JAX: nothing slow comes before a report, so only the hung rank
    # ever spends the timeout, however loaded the machine.
    out_file = tmp_path / "out"
    with out_file.open("wb") as out:
        code = launch(
            _py(
                """
                import os, time
                e = os.environ
                attempt, rank = int(e["JAX_BYTEGRAD_RESTART"]), e["JAX_BYTEGRAD_PROCESS_ID"]
                for step in range(4):
                    with open(e["JAX_BYTEGRAD_PROGRESS_FILE"], "w") as f:
                        f.write(f"{step}\\n")
                if attempt == 0 and rank == "1":
                    time.sleep(600)
                print("done", attempt, flush=True)
                """
            ),
            nproc=2,
            grace=0.5,
            max_restarts=1,
            progress_timeout=10.0,
            timeout=HANG_GUARD,
            out=out,
        )
    text = out_file.read_text()
    assert code == 0, text
    launcher_lines = [line for line in text.splitlines() if line.startswith("[launch]")]
    assert launcher_lines == [
        "[launch] no progress for 10 s from rank 1 (after step 3); stopped all 2 processes; "
        "restart 1 of 1",
        "[launch] all 2 processes exited 0; 1 of 1 restart(s) used",
    ], text
    assert "[rank 0] done 0" in text  # rank 0 had finished; the attempt still counts as failed
    assert "[rank 1] done 1" in text and "[rank 1] done 0" not in text


def test_a_hang_without_restarts_exits_125(tmp_path):
    with (tmp_path / "out").open("wb") as out:
        code = launch(
            _py("import time; time.sleep(600)"),
            nproc=1,
            grace=0.5,
            progress_timeout=0.5,
            out=out,
        )
    assert code == 125
    text = (tmp_path / "out").read_text()
    assert "no progress for 0.5 s from rank 0 (before its first step)" in text


# Real multi-process runs over Gloo ----------------------------------------------------------------


@pytest.mark.slow
@requires_gloo
def test_two_processes_by_four_devices_psum_over_gloo():
    env = {k: v for k, v in os.environ.items() if k not in _LAYOUT_VARS}
    code, out = _run_launcher(
        "--nproc",
        "2",
        "--devices-per-proc",
        "4",
        "--timeout",
        str(HANG_GUARD - 30),
        str(SCRIPTS / "psum_worker.py"),
        env=env,
    )
    assert code == 0, out
    for rank in (0, 1):
        assert (
            f"[rank {rank}] initialized process {rank}/2 with 4 local devices, source=environment"
            in out
        )
        # Device (p, j) holds 10 p + j: the sum over all 8 is 52, over "node" it is 10 + 2 j.
        assert f"[rank {rank}] psum over (node, local) = 52.0" in out
        assert f"[rank {rank}] psum over node = [10.0, 12.0, 14.0, 16.0]" in out
        assert f"[rank {rank}] OK" in out
    # Gloo prints a line per device and connection to native stdout; the launcher keeps them
    # out of its output by default (test_a_slurm_job_is_detected turns that off and sees them).
    assert "[rank 0] [Gloo] Rank 0 is connected to" not in out, out
    assert "[rank 1] [Gloo]" not in out, out


def _free_slurm_job_id() -> int:
    """A SLURM job id whose coordinator port (JAX: 61440 + id % 4096) is free on 127.0.0.1."""
    for offset in range(4096):
        port = 61440 + (os.getpid() + offset) % 4096
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return 4096 * 1000 + port - 61440
    pytest.fail("no free port in 61440..65535 for the coordinator")


@pytest.mark.slow
@requires_gloo
def test_a_slurm_job_is_detected(tmp_path):
    # Two tasks of a one-node SLURM job, as srun would start them: the layout comes from the
    # SLURM variables alone (the launcher's own are removed), through JAX's cluster detection.
    # The run also turns the launcher's filter of Gloo's lines off: that they are there is what
    # makes their absence by default (test_two_processes_by_four_devices_psum_over_gloo) count.
    env = {k: v for k, v in os.environ.items() if k not in _LAYOUT_VARS}
    env[distributed.QUIET_ENV] = "0"
    env.update(
        SLURM_JOB_ID=str(_free_slurm_job_id()),
        SLURM_STEP_NODELIST="localhost",
        SLURM_NTASKS="2",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]),
    )
    layout = _LAYOUT_VARS[:3]  # the coordinator, the process count and the id

    def command(rank: int) -> list[str]:
        unset = [arg for name in layout for arg in ("-u", name)]
        task = [f"SLURM_PROCID={rank}", f"SLURM_LOCALID={rank}"]
        return ["env", *unset, *task, sys.executable, str(SCRIPTS / "psum_worker.py")]

    out_file = tmp_path / "out"
    with out_file.open("wb") as out:
        code = launch(command, nproc=2, devices_per_proc=4, env=env, timeout=HANG_GUARD, out=out)
    text = out_file.read_text()
    assert code == 0, text
    for rank in (0, 1):
        assert f"[rank {rank}] initialized process {rank}/2 with 4 local devices, source=slurm" in (
            text
        )
        assert f"[rank {rank}] psum over (node, local) = 52.0" in text
    assert "[rank 0] [Gloo] Rank 0 is connected to" in text, text
    assert "[rank 1] [Gloo]" in text, text


@pytest.mark.slow
@requires_gloo
def test_a_failing_rank_makes_the_launcher_stop_the_other():
    # Rank 1 raises while rank 0 waits for it in a collective. Without the fail-fast exception
    # hook that the launcher turns on, rank 1 would hang at exit and the run would end only by
    # the launcher's --timeout, with 124.
    code, out = _run_launcher(
        "--nproc",
        "2",
        "--devices-per-proc",
        "4",
        "--grace",
        "3",
        "--timeout",
        str(HANG_GUARD - 30),
        str(SCRIPTS / "psum_worker.py"),
        "--fail-rank",
        "1",
    )
    assert code == 1, out
    assert "[rank 1] RuntimeError: deliberate failure on rank 1" in out
    assert "[launch] rank 1 exited with code 1" in out
    assert "[rank 0] OK" not in out
