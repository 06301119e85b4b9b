"""Every Python block of the README and docs/ runs as pasted, alone, on CPU devices.

Each ```python block runs in a process of its own with only JAX_PLATFORMS=cpu set, as a user
pastes it into a file: what it needs (imports, data, 8 CPU devices for a 2 x 4 mesh) it sets
up itself. The process is forked from a server that has imported JAX and the library once
(tests/_docs_fork_server.py), which saves about 2 s of CPU a block; no JAX backend runs before
the block's first line. A block that cannot run alone (several hosts, a GPU) starts with the
line ``# (not run: <reason>)``; it must still compile.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER = Path(__file__).resolve().parent / "_docs_fork_server.py"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"# \(not run: (?P<reason>[^)]+)\)")
TIMEOUT_S = 300


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """The ```python blocks of a markdown file: (line of the opening fence, dedented source)."""
    lines = path.read_text().splitlines()
    blocks, start = [], None
    for number, line in enumerate(lines, 1):
        fence = line.strip()
        if start is None and fence == "```python":
            start = number
        elif start is not None and fence == "```":
            blocks.append((start, textwrap.dedent("\n".join(lines[start : number - 1])) + "\n"))
            start = None
    assert start is None, f"{path.name}:{start}: a ```python block is never closed"
    return blocks


BLOCKS = [
    pytest.param(source, id=f"{path.relative_to(ROOT)}:{line}")
    for path in PAGES
    for line, source in python_blocks(path)
]


def _clean_env() -> dict[str, str]:
    # What a user's shell has: not this suite's 8-device XLA_FLAGS, nor the thread count
    # conftest.py gives XLA:CPU; the block must ask for its devices itself. Only the flag that
    # skips LLVM's expensive passes stays (see conftest.py): it changes no value and saves
    # some of each compile, which is most of a block's time.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    env["XLA_FLAGS"] = "--xla_llvm_disable_expensive_passes=true"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The process that forks one child per block; its own errors go to a file."""
    log = tmp_path_factory.mktemp("server") / "stderr"
    with log.open("w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, str(SERVER), str(TIMEOUT_S)],
            cwd=log.parent,
            env=_clean_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    proc.log = log
    yield proc
    proc.stdin.close()
    proc.wait(timeout=60)


@pytest.mark.parametrize("source", BLOCKS)
def test_block_runs(source, tmp_path, server):
    first = source.lstrip().splitlines()[0]
    if NOT_RUN.fullmatch(first.strip()):
        compile(source, "<block>", "exec")  # at least valid Python
        return
    code, stdout, stderr = _run_block(server, source, tmp_path)
    if code != 0:
        pytest.fail(f"exit {code}\n{stdout[-2000:]}\n{stderr[-4000:]}")


def _run_block(server, source: str, where: Path) -> tuple[int, str, str]:
    """Runs `source` as `python block.py` in `where`, where blocks that write files (caches,
    checkpoints) write them; returns its exit status, stdout and stderr."""
    script = where / "block.py"
    script.write_text(source)
    server.stdin.write(f"{script}\n")
    server.stdin.flush()
    answer = server.stdout.readline().strip()
    if not answer:
        pytest.fail(f"the block server died:\n{server.log.read_text()[-4000:]}")
    if answer == "timeout":
        pytest.fail(f"the block ran past {TIMEOUT_S} s")
    return int(answer), (where / "stdout").read_text(), (where / "stderr").read_text()


def test_the_checkpoint_block_runs_again(tmp_path, server):
    # A user runs a block twice: the checkpoint the first run left must not stop the second.
    (source,) = [s for _, s in python_blocks(ROOT / "docs" / "strategy.md") if "ocp." in s]
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "left_by_a_last_run").write_text("")
    code, _, stderr = _run_block(server, source, tmp_path)
    assert code == 0, stderr[-4000:]
    assert not (tmp_path / "checkpoint" / "left_by_a_last_run").exists()


def test_a_block_runs_as_a_fresh_process(tmp_path, server):
    # What the forked child must not inherit: a started backend (the block must ask for its 8
    # devices itself), a name an earlier block defined, the server's folder or `__main__`.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    code, stdout, stderr = _run_block(
        server, "import jax\nleft = 1\nprint(jax.device_count())\n", tmp_path / "a"
    )
    assert (code, stdout) == (0, "1\n"), stderr
    check = "import os, sys\nprint(__name__, sys.path[0] == os.getcwd(), sys.argv)\nleft\n"
    code, stdout, stderr = _run_block(server, check, tmp_path / "b")
    assert stdout == f"__main__ True {[str(tmp_path / 'b' / 'block.py')]}\n"
    assert code == 1 and "NameError: name 'left' is not defined" in stderr, stderr


def test_blocks_are_found():
    # A parser that found nothing would pass every test above.
    found = {path.name: len(python_blocks(path)) for path in PAGES}
    assert found["README.md"] >= 3, found
    assert sum(found.values()) >= 20, found


def test_not_run_marker_is_recognized():
    lines = ["# (not run: several hosts)", "# not run", "# (not run:)"]
    assert [bool(NOT_RUN.fullmatch(line)) for line in lines] == [True, False, False]
