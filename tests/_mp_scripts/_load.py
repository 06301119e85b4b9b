"""A busy loop beside a worker's steps, for the tests of deadlocks under load.

A worker of ``python -m jax_bytegrad.launch --nproc 2`` on a 2-core host starts one in each
process, so both cores are loaded while its threads and XLA:CPU's run the steps. It starts
after the worker compiled its programs: compiling under load shows nothing about deadlocks
and only slows every other job on the host (the loops ran for minutes when the test started
them around the whole launch). The launcher stops a worker by its process group, so a
worker it stops takes its loop with it.
"""

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def busy_loop():
    """One process spinning on a core for the duration of the ``with`` block."""
    loop = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        loop.kill()
        loop.wait()
