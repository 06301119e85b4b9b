"""glibc's huge pages for CPU workers: where `initialize` says what to set, and that it says it
once per process, in real processes started with and without the setting."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import requires_gloo
from helpers import REPO

from jax_bytegrad._src.runtime import hugepages
from jax_bytegrad.launch import launch

JEMALLOC = Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
WHERE_IT_HELPS = dict(
    tunables=None, glibc=(2, 36), glibc_malloc=True, thp_mode="madvise", on_cpu=True
)
ADVICE = "GLIBC_TUNABLES=glibc.malloc.hugetlb=1 in its environment"


def _helps_here() -> bool:
    return (
        hugepages._thp_mode() == "madvise"
        and (hugepages._glibc_version() or (0, 0)) >= (2, 35)
        and hugepages._malloc_is_glibcs()
    )


requires_a_host_where_it_helps = pytest.mark.skipif(
    not _helps_here(),
    reason="needs glibc >= 2.35 with its own malloc and transparent huge pages in madvise mode; "
    "test_advice_is_given_only_where_it_helps covers the decision",
)


@pytest.mark.parametrize(
    "change, expected",
    [
        ({}, True),
        ({"tunables": "glibc.malloc.arena_max=2"}, True),
        ({"tunables": "glibc.malloc.hugetlb=1"}, False),
        ({"tunables": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=0"}, False),
        ({"glibc": (2, 34)}, False),
        ({"glibc": None}, False),
        ({"glibc_malloc": False}, False),
        ({"thp_mode": "always"}, False),
        ({"thp_mode": "never"}, False),
        ({"thp_mode": None}, False),
        ({"on_cpu": False}, False),
    ],
    ids=[
        "unset",
        "other-tunables",
        "set",
        "turned-off-on-purpose",
        "glibc-without-the-tunable",
        "not-glibc",
        "another-malloc",
        "thp-always",
        "thp-never",
        "no-thp",
        "accelerator",
    ],
)
def test_advice_is_given_only_where_it_helps(change, expected):
    message = hugepages.advice(**{**WHERE_IT_HELPS, **change})
    assert (message is not None) == expected
    if expected:
        assert ADVICE in message and "srun" in message


@pytest.mark.parametrize(
    "platforms, expected",
    [("cpu", True), ("cpu,cuda", True), ("cuda", False), ("cuda,cpu", False)],
)
def test_the_platform_named_first_decides(platforms, expected):
    assert hugepages._on_cpu(platforms) == expected


def _advice_in_subprocess(code: str, env: dict) -> str:
    env = {**{k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}, **env}
    env["PYTHONPATH"] = str(REPO)
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


@requires_a_host_where_it_helps
@pytest.mark.parametrize(
    "start_env, expected", [({}, "advice"), ({"GLIBC_TUNABLES": hugepages.TUNABLE}, "None")]
)
def test_the_environment_the_process_started_with_is_what_counts(start_env, expected):
    # Setting the variable from Python is too late for glibc, and for the check alike.
    got = _advice_in_subprocess(
        """
        import os
        from jax_bytegrad._src.runtime import hugepages
        os.environ["GLIBC_TUNABLES"] = hugepages.TUNABLE
        message = hugepages.process_advice("cpu")
        print("None" if message is None else "advice")
        """,
        start_env,
    )
    assert got == expected


@pytest.mark.skipif(
    not JEMALLOC.exists(), reason=f"needs {JEMALLOC} to preload (Debian's libjemalloc2)"
)
def test_a_preloaded_malloc_is_told_apart_from_glibcs():
    code = "from jax_bytegrad._src.runtime import hugepages; print(hugepages._malloc_is_glibcs())"
    assert _advice_in_subprocess(code, {}) == "True"
    assert _advice_in_subprocess(code, {"LD_PRELOAD": str(JEMALLOC)}) == "False"


_JOIN_TWICE = """
import jax_bytegrad
jax_bytegrad.initialize()
jax_bytegrad.initialize()  # a second call returns the first result, silently
import jax
jax.distributed.shutdown()
print("joined")
"""


@pytest.mark.slow
@requires_gloo
@requires_a_host_where_it_helps
@pytest.mark.parametrize("hugepages_on", [False, True], ids=["started-without", "launcher-default"])
def test_initialize_says_what_to_set_once_per_process(tmp_path, hugepages_on):
    # Two real processes joining one run, as under srun: the launcher's own setting removed
    # (--no-hugepages), or kept (its default).
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env = {k: v for k, v in env.items() if not k.startswith(("JAX_BYTEGRAD_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out_file = tmp_path / "out"
    with out_file.open("wb") as out:
        code = launch(
            [sys.executable, "-c", _JOIN_TWICE],
            nproc=2,
            env=env,
            hugepages=hugepages_on,
            timeout=240,
            out=out,
        )
    text = out_file.read_text()
    assert code == 0, text
    for rank in (0, 1):
        mine = [line for line in text.splitlines() if line.startswith(f"[rank {rank}] ")]
        assert f"[rank {rank}] joined" in mine, text
        said = sum(ADVICE in line and "RuntimeWarning" in line for line in mine)
        assert said == (0 if hugepages_on else 1), text
