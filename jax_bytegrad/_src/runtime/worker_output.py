"""The launcher's copy of its workers' output: whole lines, each with its rank, noise left out.

Each worker's stdout and stderr share one pipe. `pump` reads it line by line and writes each
line whole, prefixed ``[rank k] ``, under one lock shared by all ranks: lines of different
ranks never interleave, and a line is never split (the last one, if the process died in the
middle of it, is ended with a newline). With `NoiseFilter` it leaves out two kinds of native
lines that say nothing to the user (the launcher's ``JAX_BYTEGRAD_QUIET=1``, its default):

- Gloo's connection reports, ``[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of
  connected peer ranks is : 7``, one per device and collective group. Several threads of a
  process print them at once, unlocked, piece by piece (C++ ``<<``), so pieces of several
  reports share lines; seen at 2 x 4::

      [Gloo] Rank [Gloo] Rank 5 is connected to 7 peer ranks. Expected number of connected ...
      ... peer ranks is : [Gloo] Rank 7 is connected to [Gloo] Rank 6 is connected to 7 ...
      Expected number of connected peer ranks is : 7
      7

  A line made only of these pieces and numbers is Gloo's; so is a line of numbers alone (or an
  empty one) while a report begun on an earlier line has not ended (each report ends its line
  once). A whole report whose rank connected to fewer peers than expected is kept; in a torn
  one the counts cannot be paired, and it goes with the rest.
- JAX's ``preemption_notifier.cc:NN] SIGTERM caught at ...``, once the launcher has begun to
  stop the workers: a process that called ``jax.distributed.initialize`` catches SIGTERM (JAX's
  preemption notifier) and logs it, and the launcher's own ``[launch]`` line already says that
  it stopped them. A SIGTERM from elsewhere is news, and its line stays.
"""

from __future__ import annotations

import re
import threading

_GLOO_LITERALS = (
    rb"\[Gloo\] Rank",
    rb"is connected to",
    rb"peer ranks\.",
    rb"Expected number of connected peer ranks is :",
)
_GLOO_LITERAL = re.compile(b"|".join(_GLOO_LITERALS))
_GLOO_ONLY = re.compile(rb"(?:" + b"|".join(_GLOO_LITERALS) + rb"|\d+|\s+)*")
_GLOO_REPORT = re.compile(
    rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
    rb"Expected number of connected peer ranks is : (\d+)"
)
_SIGTERM_ECHO = re.compile(rb"preemption_notifier\.cc:\d+\] SIGTERM caught")


class NoiseFilter:
    """Tells, line by line, whether a line of one rank's output is noise (see the module).

    Args:
      stopping: Set by the launcher just before it signals the workers to stop.
    """

    def __init__(self, stopping: threading.Event):
        self._stopping = stopping
        self._open = 0  # Gloo reports begun on earlier lines whose ends have not come yet

    def is_noise(self, line: bytes) -> bool:
        """Whether to leave `line` out; call it on every line of the rank, in order."""
        text = line.strip()
        if self._stopping.is_set() and _SIGTERM_ECHO.search(text):
            return True
        if _GLOO_ONLY.fullmatch(text) is None:
            self._open = 0  # the script's own line: what came before it has ended
            return False
        if _GLOO_LITERAL.search(text) is None:  # numbers alone, or nothing
            if self._open == 0:
                return False  # the script printed it
            self._open -= 1
            return True
        whole = _GLOO_REPORT.fullmatch(text)
        if whole is not None and whole[1] != whole[2]:
            return False  # fewer peers than expected: news
        self._open = max(0, self._open + text.count(b"[Gloo] Rank") - 1)
        return True


def pump(rank: int, stream, out, lock: threading.Lock, noise: NoiseFilter | None) -> None:
    """Copies a process's output to `out` line by line, each line prefixed with its rank.

    Args:
      rank: The process's rank, for the prefix.
      stream: Its binary output pipe; read to its end, then closed.
      out: The binary stream all ranks write to.
      lock: Held while one whole line is written.
      noise: Leaves out the lines it calls noise; None keeps everything.
    """
    prefix = f"[rank {rank}] ".encode()
    for line in iter(stream.readline, b""):
        if noise is not None and noise.is_noise(line):
            continue
        if not line.endswith(b"\n"):
            line += b"\n"
        with lock:
            out.write(prefix + line)
            out.flush()
    stream.close()
