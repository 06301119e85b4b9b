"""Memory each device needs to run a compiled train step, from XLA's memory analysis.

``jax.stages.Compiled.memory_analysis()`` gives, per device, the bytes of a program's
arguments, outputs, aliased buffers (outputs written into donated arguments) and temporaries,
on any backend and for meshes whose devices are not here (``sharding.gpu_mesh``). What the
program holds at once is at most the arguments, plus the outputs that are not written into
donated arguments, plus the temporaries: ``peak_bytes``, the figure a step must fit in.

XLA:GPU rematerializes (computes values again instead of keeping them) to bring a program
under a target it derives from the device's memory: 80% of it, less the program's inputs and
outputs, times ``xla_gpu_memory_limit_slop_factor`` (95%), plus the outputs. When it cannot,
it only writes a C++ log line ("Can't reduce memory use below ..."). That line's two figures
are this target and the analysis's ``peak_memory_in_bytes`` (checked on H100s compiled
deviceless), so the analysis shows it: ``MemoryStats.remat_fell_short``.
"""

import dataclasses
import os
import re
import warnings

import jax

from jax_bytegrad._src.gpu_mesh import GPUS

_GIB = 2**30
# High-bandwidth memory per chip of the TPU kinds, by ``Device.device_kind`` (as libtpu names
# them in a deviceless topology), from Google Cloud's TPU system architecture pages: v4 32,
# v5e 16, v5p 95 and v6e 32 (the pages say GB; the chips' HBM is sized in GiB, and a real
# TPU's allocator limit, which a device that is here reports, is read first).
TPU_MEMORY_BYTES = {
    "TPU v4": 32 * _GIB,
    "TPU v5 lite": 16 * _GIB,
    "TPU v5": 95 * _GIB,
    "TPU v6 lite": 32 * _GIB,
}
# XLA:GPU's share of the device it plans for, and its default slop factor, in percent.
_XLA_GPU_SHARE, _XLA_GPU_SLOP = 80, 95


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """Bytes one device needs to run a compiled program (``TrainStep.memory_stats``).

    Attributes:
      argument_bytes: the program's inputs on the device: the state's share and the batch.
      output_bytes: its outputs.
      alias_bytes: outputs written into donated inputs (counted once, in the arguments).
      temp_bytes: what XLA allocates while it runs (activations kept for the backward pass,
        gradients, the wires' buffers).
      generated_code_bytes: the compiled code.
      device_bytes: the memory of the device it was compiled for: what a real device's
        allocator may hand out (``Device.memory_stats()["bytes_limit"]``), or the shipped
        figure of a deviceless GPU (``sharding.GPUS``: 79.2 GiB for an H100) or TPU
        (``TPU_MEMORY_BYTES``: 95 GiB for a v5p); None where neither is known (a CPU).
      xla_peak_bytes: the peak XLA's own buffer assignment reports for the program's
        schedule (``peak_memory_in_bytes``), when the analysis gives it.
      remat_target_bytes: the figure XLA:GPU's rematerialization aimed at for a GPU of
        ``sharding.GPUS`` (module docstring); None on other devices.
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    device_bytes: int | None = None
    xla_peak_bytes: int | None = None
    remat_target_bytes: int | None = None

    @property
    def peak_bytes(self) -> int:
        """Arguments, outputs not aliased to them, temporaries and code: an upper bound of
        what the device holds at once while the program runs."""
        fresh_outputs = self.output_bytes - self.alias_bytes
        return self.argument_bytes + fresh_outputs + self.temp_bytes + self.generated_code_bytes

    @property
    def remat_fell_short(self) -> bool:
        """Whether XLA:GPU's rematerialization could not bring the program under its target
        (``remat_target_bytes``): XLA then logs "Can't reduce memory use below ...", and the
        program needs more than XLA planned to leave free."""
        if self.remat_target_bytes is None:
            return False
        peak = self.peak_bytes if self.xla_peak_bytes is None else self.xla_peak_bytes
        return peak > self.remat_target_bytes

    def remat_message(self) -> str:
        """What ``remat_fell_short`` means here, in a sentence ("" when it did not)."""
        if not self.remat_fell_short:
            return ""
        peak = self.peak_bytes if self.xla_peak_bytes is None else self.xla_peak_bytes
        return (
            f"XLA's rematerialization could not reach its target of "
            f"{self.remat_target_bytes / _GIB:.2f} GiB (80% of the device, less the inputs and "
            f"outputs, times XLA's slop factor); it stopped at {peak / _GIB:.2f} GiB. Shard "
            "more state (shard=), remat the model's layers, or use a smaller batch"
        )

    def fits(self, device_bytes: int | None = None) -> bool:
        """Whether ``peak_bytes`` fits in the device's memory.

        Warns when XLA's rematerialization fell short of its target (``remat_fell_short``):
        a program that fits by this count may still leave too little memory free for what
        runs outside XLA's buffers. The comparison keeps no margin: on one H200, a deviceless
        compile's peak was 1-5% under the same step compiled for the device, whose own peak
        was 0.3 GiB higher again (benchmarks/RESULTS.md, "On one H200"); leave room for that.

        Args:
          device_bytes: the device memory to compare with; by default ``self.device_bytes``.

        Raises:
          ValueError: when ``device_bytes`` is not given and the device's memory is unknown.
        """
        if device_bytes is None:
            device_bytes = self.device_bytes
        if device_bytes is None:
            raise ValueError(
                "MemoryStats.fits: the memory of the device this step was compiled for is not "
                "known (a CPU, or a GPU outside sharding.GPUS, a TPU outside "
                "TPU_MEMORY_BYTES); pass fits(device_bytes=...)"
            )
        if self.remat_fell_short:
            warnings.warn(self.remat_message(), RuntimeWarning, stacklevel=2)
        return self.peak_bytes <= device_bytes

    def __str__(self) -> str:
        device = "" if self.device_bytes is None else f" of {self.device_bytes / _GIB:.2f}"
        remat = f". {self.remat_message()}" if self.remat_fell_short else ""
        return (
            f"{self.peak_bytes / _GIB:.2f} GiB per device at most{device}: arguments "
            f"{self.argument_bytes / _GIB:.2f}, outputs "
            f"{(self.output_bytes - self.alias_bytes) / _GIB:.2f} (besides "
            f"{self.alias_bytes / _GIB:.2f} written into donated arguments), temporaries "
            f"{self.temp_bytes / _GIB:.2f} GiB{remat}"
        )


def _device(compiled: jax.stages.Compiled):
    """A device the program was compiled for (they are all alike in a mesh), or None."""
    shardings = jax.tree.leaves(
        (compiled.input_shardings, compiled.output_shardings),
        is_leaf=lambda x: isinstance(x, jax.sharding.Sharding),
    )
    return next((d for s in shardings for d in s.device_set), None)


def _device_bytes(device) -> int | None:
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # noqa: BLE001 - deviceless (topology) devices cannot be asked
        limit = None
    if limit:
        return int(limit)
    spec = next((g for g in GPUS.values() if g.name == device.device_kind), None)
    if spec is not None:
        return spec.memory_bytes
    return TPU_MEMORY_BYTES.get(device.device_kind)


def _remat_target(device, argument: int, output: int, alias: int) -> int | None:
    """The target XLA:GPU's rematerialization aims at (module docstring), for a known GPU."""
    spec = next((g for g in GPUS.values() if g.name == device.device_kind), None)
    if spec is None:
        return None
    flag = re.search(r"--xla_gpu_memory_limit_slop_factor=(\d+)", os.environ.get("XLA_FLAGS", ""))
    slop = int(flag[1]) if flag else _XLA_GPU_SLOP
    base = spec.memory_bytes * _XLA_GPU_SHARE // 100
    return max(0, base - (argument + output - alias)) * slop // 100 + output


def _of(compiled: jax.stages.Compiled) -> MemoryStats:
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise RuntimeError(
            "memory_stats: this backend gives no memory analysis of compiled programs"
        )
    sizes = [
        int(getattr(analysis, f"{name}_size_in_bytes"))
        for name in ("argument", "output", "alias", "temp", "generated_code")
    ]
    device = _device(compiled)
    peak = getattr(analysis, "peak_memory_in_bytes", None)
    return MemoryStats(
        *sizes,
        device_bytes=None if device is None else _device_bytes(device),
        xla_peak_bytes=None if peak is None else int(peak),
        remat_target_bytes=None if device is None else _remat_target(device, *sizes[:3]),
    )


def of_compiled(compiled) -> MemoryStats:
    """``MemoryStats`` of a ``jax.stages.Compiled``, or of a ``CompiledPrograms`` (the
    pipelined step's programs, which run one after another: the largest of them counts)."""
    programs = getattr(compiled, "programs", None)
    if programs is None:
        return _of(compiled)
    return max((_of(p) for p in programs.values()), key=lambda m: m.peak_bytes)


def memory_stats(lowered) -> MemoryStats:
    """The memory one device needs to run a lowered program; compiles it, runs nothing.

    ``TrainStep.memory_stats(state, batch)`` is this on each phase of a step; on
    ``step.lower(state, batch)`` it reads one phase, and that one lowering also serves
    ``communication_stats``.

    Args:
      lowered: a ``jax.stages.Lowered``, or a ``LoweredPrograms`` (the pipelined step's
        programs, which run one after another: the largest of them counts).

    Returns:
      A ``MemoryStats``.

    Raises:
      RuntimeError: the backend gives no memory analysis of compiled programs.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from jax_bytegrad.profiling import memory_stats
      >>> stats = memory_stats(jax.jit(lambda x: 2 * x).lower(jnp.ones(256, jnp.float32)))
      >>> stats.argument_bytes, stats.output_bytes
      (1024, 1024)
    """
    return of_compiled(lowered.compile())
