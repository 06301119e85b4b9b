"""Tests for jax_bytegrad.distributed.initialize() and `python -m jax_bytegrad.launch`.

The multi-process tests start real processes that talk Gloo over TCP on 127.0.0.1.
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jax
import pytest
from conftest import requires_gloo

from jax_bytegrad._src import distributed
from jax_bytegrad.launch import launch

SCRIPTS = Path(__file__).parent / "_mp_scripts"
REPO = Path(__file__).parent.parent


_LAYOUT_VARS = (
    distributed.COORDINATOR_ENV,
    distributed.NUM_PROCESSES_ENV,
    distributed.PROCESS_ID_ENV,
    distributed.CPU_DEVICES_ENV,
    "SLURM_JOB_ID",
    "SLURM_NTASKS",
    "OMPI_MCA_orte_hnp_uri",
)


def _run_launcher(*args: str, timeout: float = 55.0) -> tuple[int, str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "jax_bytegrad.launch", *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=timeout,
        text=True,
    )
    return proc.returncode, proc.stdout, time.monotonic() - start


@pytest.fixture
def clean_state(monkeypatch):
    for name in _LAYOUT_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(distributed, "_STATE", None)
    monkeypatch.setattr(distributed, "_STATE_KEY", None)


# initialize() in this process ---------------------------------------------------------------------


def test_initialize_with_nothing_set_is_a_single_process_no_op(clean_state):
    info = distributed.initialize()
    assert info == distributed.DistributedInfo(0, 1, None, "single")
    assert not jax.distributed.is_initialized()
    assert jax.process_count() == 1
    assert distributed.initialize() is info  # idempotent


def test_initialize_partial_layout_names_what_is_missing(clean_state, monkeypatch):
    monkeypatch.setenv(distributed.COORDINATOR_ENV, "127.0.0.1:1234")
    with pytest.raises(ValueError, match="JAX_BYTEGRAD_NUM_PROCESSES.*JAX_BYTEGRAD_PROCESS_ID"):
        distributed.initialize()
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
        distributed.initialize()


def test_initialize_after_backend_start_refuses_a_multi_process_layout(clean_state):
    jax.devices()  # the backend is running in this test process
    with pytest.raises(RuntimeError, match="before any JAX computation"):
        distributed.initialize("127.0.0.1:1", num_processes=2, process_id=0)


def test_initialize_single_process_sets_cpu_device_count():
    code = textwrap.dedent(
        """
        import jax_bytegrad._src.distributed as d
        info = d.initialize()
        import jax
        print(info.source, jax.local_device_count(), jax.config.jax_cpu_collectives_implementation)
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in _LAYOUT_VARS}
    env.update({distributed.CPU_DEVICES_ENV: "3", "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)})
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        check=True,
    )
    assert out.stdout.split()[-3:] == ["single", "3", "gloo"]


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


def test_launcher_command_line_turns_huge_pages_off(tmp_path):
    script = tmp_path / "show.py"
    script.write_text("import os; print(os.environ.get('GLIBC_TUNABLES', 'unset'))\n")
    for flags, expected in (((), "glibc.malloc.hugetlb=1"), (("--no-hugepages",), "unset")):
        code, output, _ = _run_launcher("--nproc", "1", *flags, str(script))
        assert code == 0, output
        assert f"[rank 0] {expected}" in output.splitlines()


def test_launch_stops_the_others_when_one_fails(tmp_path):
    start = time.monotonic()
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
            ),
            nproc=3,
            grace=1.0,
            out=out,
        )
    assert code == 7
    assert time.monotonic() - start < 30
    assert "[launch] rank 1 exited with code 7" in (tmp_path / "out").read_text()


def test_launch_timeout(tmp_path):
    with (tmp_path / "out").open("wb") as out:
        code = launch(_py("import time; time.sleep(600)"), nproc=2, timeout=1.0, grace=1.0, out=out)
    assert code == 124


# Restarts and hangs (no JAX in the children) ------------------------------------------------------


def _processes_with(marker: str) -> list[int]:
    """Ids of the live processes whose command line contains `marker` (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # it exited while we looked
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


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
        ({"max_restarts": -1}, "max_restarts=-1"),
        ({"max_restarts": 1.5}, "max_restarts=1.5"),
        ({"progress_timeout": 0}, "progress_timeout=0"),
    ],
    ids=["negative-restarts", "fractional-restarts", "zero-progress-timeout"],
)
def test_launch_rejects_bad_restart_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(_py("pass"), nproc=1, **kwargs)


def test_launcher_restarts_all_after_a_failure_and_tells_the_attempt(tmp_path):
    # Rank 1 fails on the first attempt only; rank 0 would run on forever if not stopped.
    script = tmp_path / "flaky.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            from jax_bytegrad.distributed import restart_count
            rank = os.environ["JAX_BYTEGRAD_PROCESS_ID"]
            print("attempt", restart_count(), flush=True)
            if restart_count() == 0:
                if rank == "1":
                    raise SystemExit(3)
                time.sleep(600)
            """
        )
    )
    code, output, _ = _run_launcher("--nproc", "2", "--max-restarts", "2", str(script))
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
    assert _processes_with(marker) == []


def test_a_process_without_progress_is_restarted(tmp_path):
    # Both ranks report steps 0..3; on the first attempt rank 1 then stops reporting (a hang).
    # The timeout leaves room for importing JAX on a loaded machine before the first report.
    out_file = tmp_path / "out"
    with out_file.open("wb") as out:
        code = launch(
            _py(
                """
                import os, time
                from jax_bytegrad.distributed import report_progress, restart_count
                for step in range(4):
                    report_progress(step)
                    time.sleep(0.05)
                if restart_count() == 0 and os.environ["JAX_BYTEGRAD_PROCESS_ID"] == "1":
                    time.sleep(600)
                print("done", restart_count(), flush=True)
                """
            ),
            nproc=2,
            grace=0.5,
            max_restarts=1,
            progress_timeout=10.0,
            out=out,
        )
    text = out_file.read_text()
    assert code == 0, text
    assert "[launch] no progress for 10 s from rank 1 (after step 3); stopped all 2" in text
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
    code, out, _ = _run_launcher(
        "--nproc",
        "2",
        "--devices-per-proc",
        "4",
        "--timeout",
        "50",
        str(SCRIPTS / "psum_worker.py"),
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


@pytest.mark.slow
@requires_gloo
def test_a_failing_rank_makes_the_launcher_stop_the_other():
    code, out, elapsed = _run_launcher(
        "--nproc",
        "2",
        "--devices-per-proc",
        "4",
        "--grace",
        "3",
        "--timeout",
        "50",
        str(SCRIPTS / "psum_worker.py"),
        "--fail-rank",
        "1",
    )
    assert code == 1, out
    assert "[rank 1] RuntimeError: deliberate failure on rank 1" in out
    assert "[launch] rank 1 exited with code 1" in out
    assert "[rank 0] OK" not in out
    assert elapsed < 60
