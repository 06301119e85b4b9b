"""Every Python block of the README and docs/ runs as pasted, alone, on CPU devices.

Each ```python block runs in a fresh interpreter with only JAX_PLATFORMS=cpu set, as a user
pastes it into a file: what it needs (imports, data, 8 CPU devices for a 2 x 4 mesh) it sets
up itself. A block that cannot run alone (several hosts, a GPU) starts with the line
``# (not run: <reason>)``; it must still compile.
"""

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
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
    # conftest.py gives XLA:CPU; the block must ask for its devices itself.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "NPROC")}
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


@pytest.mark.parametrize("source", BLOCKS)
def test_block_runs(source, tmp_path):
    first = source.lstrip().splitlines()[0]
    if NOT_RUN.fullmatch(first.strip()):
        compile(source, "<block>", "exec")  # at least valid Python
        return
    proc = _run_block(source, tmp_path)
    if proc.returncode != 0:
        pytest.fail(f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def _run_block(source: str, where: Path) -> subprocess.CompletedProcess:
    script = where / "block.py"
    script.write_text(source)
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=where,  # blocks that write files (caches, checkpoints) write them here
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def test_the_checkpoint_block_runs_again(tmp_path):
    # A user runs a block twice: the checkpoint the first run left must not stop the second.
    (source,) = [s for _, s in python_blocks(ROOT / "docs" / "strategy.md") if "ocp." in s]
    (tmp_path / "checkpoint").mkdir()
    (tmp_path / "checkpoint" / "left_by_a_last_run").write_text("")
    proc = _run_block(source, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not (tmp_path / "checkpoint" / "left_by_a_last_run").exists()


def test_blocks_are_found():
    # A parser that found nothing would pass every test above.
    found = {path.name: len(python_blocks(path)) for path in PAGES}
    assert found["README.md"] >= 3, found
    assert sum(found.values()) >= 20, found


def test_not_run_marker_is_recognized():
    lines = ["# (not run: several hosts)", "# not run", "# (not run:)"]
    assert [bool(NOT_RUN.fullmatch(line)) for line in lines] == [True, False, False]
