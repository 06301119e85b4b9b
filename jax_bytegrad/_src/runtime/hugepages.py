"""glibc's large allocations on transparent huge pages, for CPU workers (private).

XLA:CPU allocates its output and temporary buffers afresh at every call of a program. glibc's
malloc serves allocations above its mmap threshold (at most 32 MiB) with fresh ``mmap``s and
returns them at ``free``, so every step touches a gradient's worth of new 4 KiB pages, one page
fault each. With ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (glibc >= 2.35) malloc asks for
transparent huge pages on those mappings (``madvise``), 512 times fewer faults. Measured in
isolation (``benchmarks/malloc_pages.py``, benchmarks/RESULTS.md "Huge pages"): a jitted ``x *
2 + 1`` over 100 MB takes 24,415 page faults and 25-39 ms per call on 4 KiB pages, 398 faults
and 6-13 ms with the tunable; a ByteGrad step of a 25.2M-parameter MLP 57,500-82,300 faults,
360-990 with it.

glibc reads its tunables once, when the process starts, so nothing inside a running process
can turn this on, and ``mallopt`` at run time does not replace it (same benchmark): without
mmap, freed buffers stay in malloc's heaps, but a thread's heap holds at most 64 MiB, so
larger buffers are still mapped afresh (the same faults); with one heap for every thread the
faults go on JAX 0.10.2 but the peak memory of a loop over one 100 MB op grows 2.2-2.6x, and on
JAX 0.12 the 100 MB op still faults. A library should not impose that on a process's
allocator. ``python -m jax_bytegrad.launch`` sets the tunable in its workers' environment
(`with_hugepages`); `advice` says what to set where a process started without it, and only
where it matters.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import os
from collections.abc import Mapping
from pathlib import Path

TUNABLE = "glibc.malloc.hugetlb=1"
_KEY = "glibc.malloc.hugetlb"
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Distributions whose presence makes JAX pick an accelerator when JAX_PLATFORMS is unset.
_ACCELERATOR_PLUGINS = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu")


def with_hugepages(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with glibc's malloc on transparent huge pages, unless it already says otherwise.

    glibc reads its tunables once, when a process starts, so this is for the environment of
    processes yet to start; other tunables in ``GLIBC_TUNABLES`` are kept.

    Args:
      env: The environment of the processes to start.

    Returns:
      A copy of ``env`` whose ``GLIBC_TUNABLES`` ends in ``glibc.malloc.hugetlb=1``, or an
      unchanged copy if it already sets ``glibc.malloc.hugetlb`` (to anything).

    Examples:
      >>> from jax_bytegrad.launch import with_hugepages
      >>> with_hugepages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})["GLIBC_TUNABLES"]
      'glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1'
      >>> with_hugepages({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})["GLIBC_TUNABLES"]
      'glibc.malloc.hugetlb=0'
    """
    env = dict(env)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith(_KEY + "=") for t in tunables):
        env["GLIBC_TUNABLES"] = ":".join([*tunables, TUNABLE])
    return env


def advice(
    *,
    tunables: str | None,
    glibc: tuple[int, int] | None,
    glibc_malloc: bool,
    thp_mode: str | None,
    on_cpu: bool,
) -> str | None:
    """What to set, or None where the tunable is there, cannot help or is not needed.

    Args:
      tunables: ``GLIBC_TUNABLES`` as the process started with it (None: unset).
      glibc: glibc's (major, minor) version; None if the C library is not glibc.
      glibc_malloc: Whether ``malloc`` is glibc's (not jemalloc or tcmalloc preloaded).
      thp_mode: The kernel's transparent huge page mode (``always``, ``madvise``, ``never``).
      on_cpu: Whether JAX computes on the CPU in this process (not on a GPU or TPU).

    Returns:
      The message, or None.
    """
    if not on_cpu or glibc is None or glibc < (2, 35) or not glibc_malloc:
        return None  # buffers live elsewhere, or this malloc has no such tunable
    if thp_mode != "madvise":
        return None  # "always": every large mapping gets huge pages anyway; "never": none can
    if any(t.startswith(_KEY + "=") for t in (tunables or "").split(":")):
        return None  # set, to 1 or deliberately to something else
    return (
        "jax_bytegrad.initialize: this CPU process runs glibc's malloc on 4 KiB pages, so the "
        "gradient-size buffers that XLA:CPU allocates afresh every step cost a page fault per "
        "4 KiB (a fresh 100 MB buffer: 3-4x slower, benchmarks/RESULTS.md). Start every "
        f"process with GLIBC_TUNABLES={TUNABLE} in its environment (glibc reads it only at "
        "start), e.g. "
        f"'export GLIBC_TUNABLES={TUNABLE}' in the job script before srun or mpirun; python -m "
        "jax_bytegrad.launch sets it for its workers. glibc.malloc.hugetlb=0 keeps 4 KiB "
        "pages without this message."
    )


def _start_environ(name: str) -> str | None:
    """``name`` in the environment the process started with, which is what glibc read."""
    try:
        entries = Path("/proc/self/environ").read_bytes().split(b"\0")
    except OSError:
        return os.environ.get(name)
    prefix = name.encode() + b"="
    for entry in entries:
        if entry.startswith(prefix):
            return entry[len(prefix) :].decode(errors="replace")
    return None


def _glibc_version() -> tuple[int, int] | None:
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):
        return None


def _malloc_is_glibcs() -> bool:
    """Whether the process's ``malloc`` is libc's own, not one preloaded in its place."""
    libc_name = ctypes.util.find_library("c")
    try:
        process, libc = ctypes.CDLL(None), ctypes.CDLL(libc_name)
    except OSError:
        return False
    address = lambda f: ctypes.cast(f, ctypes.c_void_p).value  # noqa: E731
    return address(process.malloc) == address(libc.malloc)


def _thp_mode() -> str | None:
    try:
        text = _THP_ENABLED.read_text()  # "always [madvise] never"
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _on_cpu(platforms: str | None) -> bool:
    """Whether JAX will compute on the CPU, known before its backend starts.

    ``platforms`` is ``jax.config.jax_platforms`` (``JAX_PLATFORMS``). Unset, JAX takes an
    accelerator whose plugin is installed; a plugin installed on a host without its device is
    taken for an accelerator here (and the advice left out).
    """
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    names = (dist.metadata["Name"] or "" for dist in importlib.metadata.distributions())
    return not any(name.lower().startswith(_ACCELERATOR_PLUGINS) for name in names)


def process_advice(platforms: str | None) -> str | None:
    """`advice` for this process, read from its start environment, libc and kernel."""
    if not _on_cpu(platforms):
        return None
    return advice(
        tunables=_start_environ("GLIBC_TUNABLES"),
        glibc=_glibc_version(),
        glibc_malloc=_malloc_is_glibcs(),
        thp_mode=_thp_mode(),
        on_cpu=True,
    )
