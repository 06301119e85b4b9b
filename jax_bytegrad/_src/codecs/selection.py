"""The choice for ``implementation=None``: which implementation runs each block kernel.

A ``Kernel`` is a block op (``quantize_blocks``, ``dequantize_blocks``, ``average_requantize``)
with everything static about its call. ``select`` names the implementation that runs it, which
``codecs.resolve`` dispatches to: the XLA reference where no compiled kernel can run (a mesh of
TPUs or CPUs, or no supported GPU); on a supported GPU, the compiled Mosaic GPU kernel once it
has reproduced the reference on a small input (``check``). That check runs once per process,
device kind and kernel, within ``CHECK_TIMEOUT_S``, and ``CHECKS`` keeps its verdicts. A kernel
that fails it is replaced by the XLA path for that kernel alone, with one warning.
"""

import dataclasses
import functools
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np

# The package, read at call time: it imports this module while it initialises.
from jax_bytegrad._src import codecs
from jax_bytegrad._src.codecs import pallas, reference
from jax_bytegrad._src.platforms import platform_of

# Seconds one kernel's check may take, compile included: a compile takes about a second, and a
# layout search that Mosaic GPU cannot finish would take minutes of the user's first step.
CHECK_TIMEOUT_S = 20.0


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel: a block op and everything static about its call except the block count.

    Attributes:
      op: ``"quantize_blocks"``, ``"dequantize_blocks"`` or ``"average_requantize"``.
      codec: its ``Codec`` (bits and rounding; the implementation is what is being chosen).
      block_size: values per block.
      dtype: the input dtype's name (quantize_blocks reads float32, bfloat16 or float16).
      chunks: how many chunks average_requantize reads; 0 for the other ops.
      weight: average_requantize's weight; None for the other ops.
    """

    op: str
    codec: "codecs.Codec"
    block_size: int
    dtype: str = "float32"
    chunks: int = 0
    weight: float | None = None

    @classmethod
    def of(cls, op: str, codec: "codecs.Codec", *arrays, weight: float | None = None) -> "Kernel":
        """The kernel of the call ``<op>(codec, *arrays, ..., weight=weight)``."""
        codec = dataclasses.replace(codec, implementation=None)
        first = arrays[0]
        if op == "quantize_blocks":
            return cls(op, codec, first.shape[-1], dtype=jnp.dtype(first.dtype).name)
        block_size = first.shape[-1] * codec.format.per_byte
        if op == "dequantize_blocks":
            return cls(op, codec, block_size)
        if op != "average_requantize":
            raise ValueError(f"{op!r} is not a block op; expected one of {codecs.BLOCK_OPS}")
        return cls(op, codec, block_size, chunks=first.shape[0], weight=float(weight))

    @property
    def encodes(self) -> bool:
        """Whether the op writes codes, and so takes a rounding and a key."""
        return self.op != "dequantize_blocks"

    def __str__(self) -> str:
        args = [f"bits={self.codec.bits}", f"block_size={self.block_size}"]
        if self.op == "quantize_blocks":
            args.append(f"dtype={self.dtype}")
        if self.encodes:
            args.append(f"rounding={'stochastic' if self.codec.stochastic else 'nearest'!r}")
        if self.op == "average_requantize":
            args += [f"chunks={self.chunks}", f"weight={self.weight}"]
        return f"{self.op}({', '.join(args)})"

    def run(self, implementation: str, *arrays, key: jax.Array | None = None):
        """Runs this kernel's op with ``implementation`` on ``arrays`` (and ``key``)."""
        codec = dataclasses.replace(self.codec, implementation=implementation)
        if self.op == "quantize_blocks":
            return codecs.quantize_blocks(codec, *arrays, key)
        if self.op == "dequantize_blocks":
            return codecs.dequantize_blocks(codec, *arrays)
        return codecs.average_requantize(codec, *arrays, key, weight=self.weight)

    def example(self) -> tuple[np.ndarray, ...]:
        """A small input that reaches every branch: zeros, a constant block, NaN and inf.

        Several programs' worth of blocks at the default tile, so the grid has more than one.
        """
        num_blocks = max(8, 2**14 // self.block_size)

        def values(seed):
            rng = np.random.default_rng(seed)
            x = rng.standard_normal((num_blocks, self.block_size))
            x *= rng.uniform(1e-3, 1e3, (num_blocks, 1))
            x[0, :5] = 0.0
            x[1] = -1.5
            x[2] = np.abs(x[2]) + 7.0
            x[3, 11] = np.nan
            x[4, 3] = np.inf
            return x.astype(np.float32)

        if self.op == "quantize_blocks":
            return (values(1).astype(jnp.dtype(self.dtype)),)
        encode = jax.jit(
            functools.partial(reference.quantize_blocks, codecs.Codec(bits=self.codec.bits))
        )
        if self.op == "dequantize_blocks":
            return tuple(np.asarray(a) for a in encode(values(1)))
        chunks = [encode(values(seed)) for seed in range(1, self.chunks + 1)]
        codes = np.stack([np.asarray(c) for c, _ in chunks])
        header = np.stack([np.asarray(h) for _, h in chunks])
        return codes, header


def _unpacked(codes: np.ndarray, bits: int) -> np.ndarray:
    return np.asarray(reference.unpack(jnp.asarray(codes), bits)).astype(np.int32)


def mismatch(kernel: Kernel, got, want) -> str | None:
    """How ``got`` differs from the reference's ``want`` beyond float rounding, or None.

    Allowed, as the compiled kernel's docstring explains: a scale a few ulps apart, and a zero
    point or a code one step apart. Decoded values may differ by an ulp.
    """
    if kernel.op == "dequantize_blocks":
        got, want = np.asarray(got), np.asarray(want)
        if got.shape != want.shape or not np.allclose(got, want, rtol=2**-22, equal_nan=True):
            return "its decoded values differ from the reference's"
        return None
    (codes, header), (ref_codes, ref_header) = ([np.asarray(a) for a in out] for out in (got, want))
    if codes.shape != ref_codes.shape or header.shape != ref_header.shape:
        return f"its outputs have shapes {codes.shape}, {header.shape}"
    if not np.allclose(header[:, 0], ref_header[:, 0], rtol=2**-20, equal_nan=True):
        return "its block scales differ from the reference's"
    if np.any(np.abs(header[:, 1] - ref_header[:, 1]) > 1):
        return "its zero points differ from the reference's"
    bits = kernel.codec.bits
    steps = np.abs(_unpacked(codes, bits) - _unpacked(ref_codes, bits))
    if np.any(steps > 1):
        return f"{np.count_nonzero(steps > 1)} codes differ from the reference's by more than 1"
    return None


def check(kernel: Kernel, device) -> str | None:
    """Runs ``kernel``'s compiled version and the reference on ``device``; None if they agree.

    Returns why not otherwise: the compiler's error, a wrong result, or a timeout. Runs in a
    thread of its own, so a trace under way in the caller's thread stays untouched, and so a
    compile that does not end within ``CHECK_TIMEOUT_S`` is abandoned rather than awaited.
    """
    outcome = {}

    def work():
        try:
            with jax.default_device(device):
                arrays = kernel.example()
                key = jax.random.key(0) if kernel.codec.stochastic else None
                got = jax.jit(functools.partial(kernel.run, "pallas"))(*arrays, key=key)
                want = jax.jit(functools.partial(kernel.run, "xla"))(*arrays, key=key)
                outcome["result"] = mismatch(kernel, got, want)
        except Exception as error:  # noqa: BLE001 - any failure means "do not use it"
            outcome["result"] = f"it failed: {error!r:.300}"

    worker = threading.Thread(target=work, name=f"check {kernel}", daemon=True)
    worker.start()
    worker.join(CHECK_TIMEOUT_S)
    if worker.is_alive():
        return f"its check did not finish within {CHECK_TIMEOUT_S:g} s (compile included)"
    return outcome["result"]


def _device_kinds() -> dict[str, jax.Device]:
    """One local device of each kind the default backend has."""
    return {d.device_kind: d for d in reversed(jax.local_devices())}


class KernelChecks:
    """The verdicts of the compiled kernels' checks (``check``): one per device kind and
    kernel, each found once and kept, since a check compiles and runs the kernel.

    They are facts about this process's devices, so the process holds one set: ``CHECKS``,
    which ``select`` reads. Thread-safe: a check runs under the lock, so two threads that
    trace at once check a kernel once.
    """

    def __init__(self) -> None:
        self._verdicts: dict[tuple[str, Kernel], bool] = {}
        self._lock = threading.Lock()

    def works(self, kernel: Kernel) -> bool:
        """Whether ``kernel``'s compiled version passed its check on every kind of local
        device; checks it (once per kind) where it has not been, with one warning where it
        fails."""
        with self._lock:
            works = True
            for kind, device in _device_kinds().items():
                if (kind, kernel) not in self._verdicts:
                    why = check(kernel, device)
                    if why is not None:
                        warnings.warn(
                            f"jax_bytegrad: the compiled Mosaic GPU kernel {kernel} is not used "
                            f"on {kind}: {why}. The XLA implementation runs this kernel "
                            "instead; the other kernels are unaffected. Pass "
                            "implementation='xla' to skip this check, or "
                            "implementation='pallas' to see the kernel's own error.",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                    self._verdicts[kind, kernel] = why is None
                works = works and self._verdicts[kind, kernel]
            return works

    def clear(self) -> None:
        """Forgets every verdict, so the next ``works`` checks again."""
        with self._lock:
            self._verdicts.clear()


# This process's verdicts (``KernelChecks``).
CHECKS = KernelChecks()


def select(kernel: Kernel) -> str:
    """The implementation that runs ``kernel`` for ``implementation=None``.

    The XLA reference unless the default backend is a GPU that Mosaic GPU supports, the mesh
    being traced is of that backend (``platform_of``; outside ``shard_map``, the backend
    itself), and the compiled kernel passed its check on every kind of local device (see
    ``check``). So a TPU or CPU mesh takes XLA's codec even on a host with a Hopper GPU.
    """
    on_this_backend = platform_of() == jax.default_backend()
    if on_this_backend and pallas.is_supported() and CHECKS.works(kernel):
        return "pallas"
    return "xla"


def clear_checks() -> None:
    """Forgets every kernel's check, so the next ``select`` checks again."""
    CHECKS.clear()
