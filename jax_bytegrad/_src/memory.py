"""Memory each device needs to run a compiled train step, from XLA's memory analysis.

``jax.stages.Compiled.memory_analysis()`` gives, per device, the bytes of a program's
arguments, outputs, aliased buffers (outputs written into donated arguments) and temporaries,
on any backend and for meshes whose devices are not here (``sharding.gpu_mesh``). What the
program holds at once is at most the arguments, plus the outputs that are not written into
donated arguments, plus the temporaries: ``peak_bytes``, the figure a step must fit in.
"""

import dataclasses

import jax

_GIB = 2**30


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
    """

    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Arguments, outputs not aliased to them, temporaries and code: an upper bound of
        what the device holds at once while the program runs."""
        fresh_outputs = self.output_bytes - self.alias_bytes
        return self.argument_bytes + fresh_outputs + self.temp_bytes + self.generated_code_bytes

    def fits(self, device_bytes: int) -> bool:
        """Whether ``peak_bytes`` fits in ``device_bytes`` of device memory."""
        return self.peak_bytes <= device_bytes

    def __str__(self) -> str:
        return (
            f"{self.peak_bytes / _GIB:.2f} GiB per device at most: arguments "
            f"{self.argument_bytes / _GIB:.2f}, outputs "
            f"{(self.output_bytes - self.alias_bytes) / _GIB:.2f} (besides "
            f"{self.alias_bytes / _GIB:.2f} written into donated arguments), temporaries "
            f"{self.temp_bytes / _GIB:.2f} GiB"
        )


def _of(compiled: jax.stages.Compiled) -> MemoryStats:
    analysis = compiled.memory_analysis()
    if analysis is None:
        raise RuntimeError(
            "memory_stats: this backend gives no memory analysis of compiled programs"
        )
    return MemoryStats(
        argument_bytes=int(analysis.argument_size_in_bytes),
        output_bytes=int(analysis.output_size_in_bytes),
        alias_bytes=int(analysis.alias_size_in_bytes),
        temp_bytes=int(analysis.temp_size_in_bytes),
        generated_code_bytes=int(analysis.generated_code_size_in_bytes),
    )


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
    programs = getattr(lowered, "programs", None)
    if programs is None:
        return _of(lowered.compile())
    return max((_of(p.compile()) for p in programs.values()), key=lambda m: m.peak_bytes)
