"""Runs the docs' Python blocks for tests/test_docs.py, each in a process of its own, as
``python block.py`` would, without paying Python's start and the import of JAX for each block.

It imports NumPy, JAX, Optax and jax_bytegrad once (an import starts no JAX backend), then forks
a child per block. To the block the child is a fresh process: its own ``__main__`` namespace,
working directory, argv, ``sys.path[0]``, stdin, stdout and stderr, and a JAX backend that its
own ``jax.config.update("jax_num_cpu_devices", 8)`` still comes before; nothing a block does
reaches the next. One thing differs: a block that uses a submodule it never imported (say
``jax.experimental.pallas`` after ``import jax`` alone) would find it here, as jax_bytegrad
imported it.

Protocol: the path of a block's script, one per line on stdin; each answer is one line on
stdout: the child's exit status as ``subprocess`` gives it (negative: killed by that signal),
or ``timeout`` if it ran past the seconds given as the first argument (it is then killed). The
child writes its stdout and stderr to ``stdout`` and ``stderr`` next to the script.
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

import jax  # noqa: F401
import numpy  # noqa: F401
import optax  # noqa: F401

import jax_bytegrad  # noqa: F401


def _wait(pid: int, timeout: float) -> str:
    # Polled, not waited for in a thread: the server stays single-threaded, so forking is safe.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return str(os.waitstatus_to_exitcode(status))
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "timeout"


def serve(timeout: float) -> Path:
    """Answers requests until stdin closes, then exits; returns, in a child, the block to run."""
    while line := sys.stdin.readline():
        script = Path(line.strip())
        pid = os.fork()
        if pid == 0:
            return script
        print(_wait(pid, timeout), flush=True)
    sys.exit(0)


def become(script: Path) -> None:
    """Makes this child look like ``python script`` started in the script's folder."""
    where = script.parent
    os.chdir(where)
    sys.argv = [str(script)]
    sys.path[0] = str(where)  # where Python puts the script's folder; this file's is not on it
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        out = os.open(where / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    os.close(stdin)
    # The server's stdin object may hold what it read ahead; stdout and stderr were flushed
    # before the fork and now write to the files.
    sys.stdin = sys.__stdin__ = open(0, closefd=False)


if __name__ == "__main__":
    block = serve(float(sys.argv[1]))
    become(block)
    del block
    # At this file's top level, as Python runs a script: an uncaught exception prints its
    # traceback and exits 1, and the exit handlers run.
    runpy.run_path(sys.argv[0], run_name="__main__")
