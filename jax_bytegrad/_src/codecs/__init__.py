"""Quantization codecs: one interface, three implementations, and a choice per kernel.

Every codec implements the three block functions of ``reference.py`` with the same results:
``quantize_blocks``, ``dequantize_blocks`` and ``average_requantize``. A codec's function takes
a ``Kernel`` (the op's static arguments: bits, rounding, weight), then the reference's arrays,
so the static arguments are spelled once, in the reference's signatures.

* ``"xla"``: ``reference.py``, pure jnp. It owns the semantics and runs everywhere.
* ``"pallas"``: ``pallas.py``'s kernels compiled by Mosaic GPU, for NVIDIA GPUs of compute
  capability >= 9.0. They lower for CUDA from any host; lowering them for another platform
  raises ``NotImplementedError``.
* ``"pallas_interpret"``: the same kernel bodies in the Pallas interpreter, on any backend.

``implementation=None`` asks for the best codec, chosen per kernel by ``select``: the XLA
reference where no compiled kernel can run; on a supported GPU, the compiled kernel once it
has reproduced the reference on a small input. That check runs once per process, device kind
and kernel (an op with everything static about its call), with a time bound. A kernel that
fails it or runs out of time is replaced by the XLA path for that kernel alone, with one
warning that names the kernel and why; the other kernels keep their compiled versions.
"""

import dataclasses
import functools
import threading
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jax_bytegrad._src.codecs import pallas, reference

# Seconds one kernel's check may take, compile included: a compile takes about a second, and a
# layout search that Mosaic GPU cannot finish would take minutes of the user's first step.
CHECK_TIMEOUT_S = 20.0
# The ops every codec implements, named as the reference's functions.
OPS = ("quantize_blocks", "dequantize_blocks", "average_requantize")


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel: an op and everything static about its call except the block count.

    Attributes:
      op: ``"quantize_blocks"``, ``"dequantize_blocks"`` or ``"average_requantize"``.
      bits: 8 or 4.
      block_size: values per block.
      dtype: the input dtype's name (quantize_blocks reads float32, bfloat16 or float16).
      stochastic: stochastic rounding (the encoding ops).
      chunks: how many chunks average_requantize reads; 0 for the other ops.
      weight: average_requantize's weight; None for the other ops.
    """

    op: str
    bits: int
    block_size: int
    dtype: str = "float32"
    stochastic: bool = False
    chunks: int = 0
    weight: float | None = None

    @classmethod
    def of(
        cls, op: str, *arrays, bits: int = 8, stochastic: bool = False, weight: float | None = None
    ) -> "Kernel":
        """The kernel of the call ``reference.<op>(*arrays, bits=..., ...)``.

        Takes the reference's static keywords, so that a codec's caller passes them as it
        would to the reference; a keyword the reference does not take raises ``TypeError``.
        """
        first = arrays[0]
        if op == "quantize_blocks":
            dtype = jnp.dtype(first.dtype).name
            return cls(op, bits, first.shape[-1], dtype=dtype, stochastic=stochastic)
        block_size = first.shape[-1] * 8 // bits
        if op == "dequantize_blocks":
            if stochastic or weight is not None:
                raise TypeError("dequantize_blocks takes neither stochastic nor weight")
            return cls(op, bits, block_size)
        if op != "average_requantize":
            raise ValueError(f"unknown codec op {op!r}; expected one of {OPS}")
        if weight is None:
            raise TypeError("average_requantize needs weight=...")
        chunks = first.shape[0]
        return cls(op, bits, block_size, stochastic=stochastic, chunks=chunks, weight=float(weight))

    @property
    def encodes(self) -> bool:
        """Whether the op writes codes, and so takes a rounding and a key."""
        return self.op != "dequantize_blocks"

    def arguments(self) -> dict:
        """The static keyword arguments of this kernel's reference function."""
        arguments = {"bits": self.bits}
        if self.encodes:
            arguments["stochastic"] = self.stochastic
        if self.weight is not None:
            arguments["weight"] = self.weight
        return arguments

    def __str__(self) -> str:
        args = [f"bits={self.bits}", f"block_size={self.block_size}"]
        if self.op == "quantize_blocks":
            args.append(f"dtype={self.dtype}")
        if self.encodes:
            args.append(f"rounding={'stochastic' if self.stochastic else 'nearest'!r}")
        if self.op == "average_requantize":
            args += [f"chunks={self.chunks}", f"weight={self.weight}"]
        return f"{self.op}({', '.join(args)})"

    def run(self, codec: "Codec", *arrays, key: jax.Array | None = None):
        """Calls this kernel's op of ``codec`` on ``arrays`` (and ``key``, if it encodes)."""
        fn = getattr(codec, self.op)
        if self.encodes:
            return fn(self, *arrays, key=key)
        if key is not None:
            raise TypeError(f"{self.op} takes no key")
        return fn(self, *arrays)

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
        encode = jax.jit(functools.partial(reference.quantize_blocks, bits=self.bits))
        if self.op == "dequantize_blocks":
            return tuple(np.asarray(a) for a in encode(values(1)))
        chunks = [encode(values(seed)) for seed in range(1, self.chunks + 1)]
        codes = np.stack([np.asarray(c) for c, _ in chunks])
        header = np.stack([np.asarray(h) for _, h in chunks])
        return codes, header


@dataclasses.dataclass(frozen=True)
class Codec:
    """One implementation of the block codec: a function per op of ``reference.py``.

    Each takes the ``Kernel`` (the op's static arguments) and then the reference function's
    arrays: ``quantize_blocks(kernel, x, key=None) -> (codes, header)``,
    ``dequantize_blocks(kernel, codes, header) -> values`` and
    ``average_requantize(kernel, codes, header, key=None) -> (codes, header)``. The static
    arguments are written once, in the reference's signature; ``Kernel.of`` reads a call in
    that form.

    Attributes:
      name: ``"xla"``, ``"pallas"`` or ``"pallas_interpret"``.
      quantize_blocks: the encoder.
      dequantize_blocks: the decoder.
      average_requantize: the fused decode, weighted sum and re-encode.
    """

    name: str
    quantize_blocks: Callable
    dequantize_blocks: Callable
    average_requantize: Callable


def _reference_op(op: str) -> Callable:
    semantics = getattr(reference, op)
    return lambda kernel, *arrays, **key: semantics(*arrays, **key, **kernel.arguments())


def _pallas_codec(name: str, interpret: bool) -> Codec:
    return Codec(
        name,
        functools.partial(pallas.quantize_blocks, interpret=interpret),
        functools.partial(pallas.dequantize_blocks, interpret=interpret),
        functools.partial(pallas.average_requantize, interpret=interpret),
    )


CODECS: dict[str, Codec] = {
    "xla": Codec("xla", *(_reference_op(op) for op in OPS)),
    "pallas": _pallas_codec("pallas", interpret=False),
    "pallas_interpret": _pallas_codec("pallas_interpret", interpret=True),
}


def _unpacked(codes: np.ndarray, bits: int) -> np.ndarray:
    codes = codes.astype(np.int32)
    return codes if bits == 8 else np.concatenate([codes & 15, codes >> 4], axis=-1)


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
    steps = np.abs(_unpacked(codes, kernel.bits) - _unpacked(ref_codes, kernel.bits))
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
                key = jax.random.key(0) if kernel.stochastic else None
                got = jax.jit(functools.partial(kernel.run, CODECS["pallas"]))(*arrays, key=key)
                want = jax.jit(functools.partial(kernel.run, CODECS["xla"]))(*arrays, key=key)
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


_verdicts: dict[tuple[str, Kernel], bool] = {}
_verdicts_lock = threading.Lock()


def _compiled_kernel_works(kernel: Kernel) -> bool:
    with _verdicts_lock:
        works = True
        for kind, device in _device_kinds().items():
            if (kind, kernel) not in _verdicts:
                why = check(kernel, device)
                if why is not None:
                    warnings.warn(
                        f"jax_bytegrad: the compiled Mosaic GPU kernel {kernel} is not used on "
                        f"{kind}: {why}. The XLA implementation runs this kernel instead; the "
                        "other kernels are unaffected. Pass implementation='xla' to skip this "
                        "check, or implementation='pallas' to see the kernel's own error.",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                _verdicts[kind, kernel] = why is None
            works = works and _verdicts[kind, kernel]
        return works


def select(kernel: Kernel) -> Codec:
    """The codec that runs ``kernel`` for ``implementation=None``.

    The XLA reference unless the default backend is a GPU that Mosaic GPU supports and the
    compiled kernel passed its check on every kind of local device (see ``check``).
    """
    if pallas.is_supported() and _compiled_kernel_works(kernel):
        return CODECS["pallas"]
    return CODECS["xla"]


def clear_checks() -> None:
    """Forgets every kernel's check, so the next ``select`` checks again."""
    with _verdicts_lock:
        _verdicts.clear()
