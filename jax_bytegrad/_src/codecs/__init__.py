"""The codecs: one object per codec, every implementation of every op, and a choice per kernel.

``Codec`` is a codec: its width (bits, with its ``widths.Format``: packing, levels, default
block, whether kernels exist), its rounding and which implementation runs it; its ops
(``quantize_blocks``, ``dequantize_blocks``, ``average_requantize``), and what the wires ask
of a width (``code_bytes``, ``auto_wire``, ``integer_width``). It is the one object that
travels from a ``SyncConfig`` (``SyncConfig.codec``) or the arguments of ``quantize`` to an
implementation, which reads its ``bits`` and ``stochastic``. Outside the codecs nothing tests
a width by value: it asks the codec. A new width is a row of ``widths.FORMATS``, and its
reference follows from the shared grid (``grid.py``) and packing (``reference.pack``).

``REGISTRY`` holds every implementation of every op, by op and then by name. Within an op,
every implementation takes the same arguments (a ``Codec`` first) and returns the same
structure as its ``"xla"`` one, and the functions here of the op's name dispatch on
``codec.implementation``:

* The block codec (``reference.py``): ``quantize_blocks``, ``dequantize_blocks`` and
  ``average_requantize``.

  * ``"xla"``: ``reference.py``, pure jnp. It owns the semantics and runs everywhere.
  * ``"pallas"``: ``pallas.py``'s kernels compiled by Mosaic GPU, for NVIDIA GPUs of compute
    capability >= 9.0. They lower for CUDA from any host; lowering them for another platform
    raises ``NotImplementedError``.
  * ``"pallas_interpret"``: the same kernel bodies in the Pallas interpreter, on any backend.

  The scatter-gather wire's three compute stages compose them here (``sg_encode``,
  ``sg_average``, ``sg_decode``), so that ``wire.py`` speaks to the codecs through one door.

* The integer wire's codec (``integer.py``): ``integer_bounds``, ``integer_encode``,
  ``decode_factors`` and ``integer_decode``, ``"xla"`` only, resolved together once per sync
  plan (``IntegerOps``). Each is an elementwise pass or a
  row reduction that XLA fuses into one pass over memory (the decode into the optimizer's
  own), which no kernel could make move fewer bytes (docs/gpu.md). Asking one of them for
  ``"pallas"`` or ``"pallas_interpret"`` raises ``NotImplementedError``, as asking for a
  kernel where none can run does: an explicit implementation never falls back silently.

``implementation=None`` asks for the best implementation: an op's only one, or for the block
codec the one ``selection.select`` chooses per kernel (``selection.py``): the XLA reference
where no compiled kernel can run (a mesh of TPUs or CPUs, or no supported GPU); on a supported
GPU, the compiled kernel once it has reproduced the reference on a small input
(``selection.check``). That check runs once per process, device kind and kernel (an op with
everything static about its call), with a time bound. A kernel that fails it or runs out of
time is replaced by the XLA path for that kernel alone, with one warning that names the kernel
and why; the other kernels keep their compiled versions.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Literal, get_args

import jax
import jax.numpy as jnp

from jax_bytegrad._src.codecs import integer, pallas, reference, selection, widths

Implementation = Literal["xla", "pallas", "pallas_interpret"]
# Every implementation name an op may have.
IMPLEMENTATIONS = get_args(Implementation)
# Floats per block header: [scale, zero point].
HEADER_WIDTH = 2


@dataclasses.dataclass(frozen=True)
class Codec:
    """A codec: how values are coded, and the ops that code them. Frozen, hashable.

    Attributes:
      bits: bits per code, 8, 4 or 2 (``widths.FORMATS``; packed ``8 // bits`` per byte).
      stochastic: stochastic (unbiased) rounding, ``rounding="stochastic"``; the ops that
        encode then take a PRNG key.
      implementation: ``"xla"``, ``"pallas"``, ``"pallas_interpret"``, or None for the best
        available (module docstring). A width without kernels (``Format.kernels``: 2 bits)
        runs the XLA reference.

    Raises:
      ValueError: for a width not in ``widths.FORMATS``.
      NotImplementedError: for a Pallas implementation of a width that has no kernels.

    Examples:
      >>> import jax.numpy as jnp
      >>> codes, header = Codec(bits=4).quantize_blocks(jnp.ones((2, 256)))
      >>> codes.shape, header.shape
      ((2, 128), (2, 2))
      >>> Codec(bits=2).code_bytes(512), Codec(bits=2).auto_wire(2)
      (128, 'scatter_gather')
    """

    bits: int = 8
    stochastic: bool = False
    implementation: Implementation | None = None

    def __post_init__(self) -> None:
        fmt = widths.format_of(self.bits, "Codec")
        if self.implementation in ("pallas", "pallas_interpret") and not fmt.kernels:
            raise NotImplementedError(
                f"jax_bytegrad: {self.bits}-bit codes have no Pallas kernels (their XLA "
                f"reference is the codec); pass implementation=None or 'xla', got "
                f"{self.implementation!r}"
            )

    @property
    def format(self) -> widths.Format:
        """This width's ``widths.Format``."""
        return widths.FORMATS[self.bits]

    @property
    def block_size(self) -> int:
        """The default values per block of this width."""
        return self.format.block_size

    def code_bytes(self, block_size: int) -> int:
        """Bytes of packed codes per block of ``block_size`` values, its header aside."""
        return self.format.code_bytes(block_size)

    def auto_wire(self, group_size: int) -> str:
        """The wire ``wire="auto"`` picks for ``group_size`` devices: ``"allreduce"`` while
        this width's codes of that many devices sum on the integer wire with enough levels
        (``Format.auto_allreduce_group``), ``"scatter_gather"`` otherwise."""
        return "allreduce" if group_size <= self.format.auto_allreduce_group else "scatter_gather"

    def check_integer(self, group_size: int, where: str = "wire='allreduce'") -> None:
        """Raises a ``ValueError`` unless this width's codes of ``group_size`` devices can be
        summed on the integer wire (``integer.check_fits``)."""
        integer.check_fits(self.bits, group_size, where)

    def integer_fits(self, group_size: int) -> bool:
        """Whether this width's codes of ``group_size`` devices sum on the integer wire."""
        return integer.fits(self.bits, group_size)

    def integer_width(self, group_size: int, platform: str | None = None) -> integer.Width:
        """The integer wire's width and levels per device for ``group_size`` devices
        (``integer.allreduce_width``)."""
        return integer.allreduce_width(self.bits, group_size, platform)

    def quantize_blocks(self, x: jax.Array, key: jax.Array | None = None):
        """Quantizes rows of ``x``: the module's ``quantize_blocks``."""
        return quantize_blocks(self, x, key)

    def dequantize_blocks(self, codes: jax.Array, header: jax.Array) -> jax.Array:
        """Decodes rows of codes: the module's ``dequantize_blocks``."""
        return dequantize_blocks(self, codes, header)

    def average_requantize(self, codes, header, key=None, *, weight: float):
        """Averages and requantizes n chunks: the module's ``average_requantize``."""
        return average_requantize(self, codes, header, key, weight=weight)


def _interpreted(kernel: Callable) -> Callable:
    return functools.partial(kernel, interpret=True)


BLOCK_OPS = ("quantize_blocks", "dequantize_blocks", "average_requantize")
INTEGER_OPS = ("integer_bounds", "integer_encode", "decode_factors", "integer_decode")
# Every implementation of every op: op -> implementation name -> function (module docstring).
REGISTRY: dict[str, dict[str, Callable]] = {
    "quantize_blocks": {
        "xla": reference.quantize_blocks,
        "pallas": pallas.quantize_blocks,
        "pallas_interpret": _interpreted(pallas.quantize_blocks),
    },
    "dequantize_blocks": {
        "xla": reference.dequantize_blocks,
        "pallas": pallas.dequantize_blocks,
        "pallas_interpret": _interpreted(pallas.dequantize_blocks),
    },
    "average_requantize": {
        "xla": reference.average_requantize,
        "pallas": pallas.average_requantize,
        "pallas_interpret": _interpreted(pallas.average_requantize),
    },
    "integer_bounds": {"xla": integer.integer_bounds},
    "integer_encode": {"xla": integer.integer_encode},
    "decode_factors": {"xla": integer.decode_factors},
    "integer_decode": {"xla": integer.integer_decode},
}


def lookup(op: str, implementation: str) -> Callable:
    """The implementation named ``implementation`` of ``op``.

    Raises:
      NotImplementedError: where ``op`` has none of that name, saying what to pass instead.
    """
    implementations = REGISTRY[op]
    if implementation in implementations:
        return implementations[implementation]
    if implementation in IMPLEMENTATIONS and op in INTEGER_OPS:
        raise NotImplementedError(
            f"jax_bytegrad: implementation={implementation!r} asks for the Pallas kernels, and "
            f"the integer wire (wire='allreduce', which wire='auto' picks for 8-bit codes "
            f"summed over at most 8 devices) has none: its op {op} is an XLA fusion, which "
            "already moves the fewest bytes (docs/gpu.md). Pass implementation=None or 'xla', "
            "or wire='scatter_gather' to run the kernels"
        )
    raise NotImplementedError(
        f"jax_bytegrad: {op} has no implementation {implementation!r}; it has "
        f"{', '.join(map(repr, implementations))}"
    )


def resolve(op: str, codec: Codec, *arrays, weight: float | None = None) -> Callable:
    """The function that runs ``op`` on ``arrays`` for ``codec``: the implementation it
    names, or for None the best available (the op's only one, or ``selection.select``'s choice)."""
    if codec.implementation is not None:
        return lookup(op, codec.implementation)
    if len(REGISTRY[op]) == 1 or not codec.format.kernels:
        return REGISTRY[op]["xla"]
    return lookup(op, selection.select(selection.Kernel.of(op, codec, *arrays, weight=weight)))


# --- The ops: each dispatches on codec.implementation and takes its implementations' arguments.


def quantize_blocks(codec: Codec, x: jax.Array, key: jax.Array | None = None):
    """Quantizes rows of a (num_blocks, block_size) array: ``reference.quantize_blocks``."""
    return resolve("quantize_blocks", codec, x)(codec, x, key)


def dequantize_blocks(codec: Codec, codes: jax.Array, header: jax.Array) -> jax.Array:
    """Decodes (num_blocks, block_size * bits // 8) codes: ``reference.dequantize_blocks``."""
    return resolve("dequantize_blocks", codec, codes, header)(codec, codes, header)


def average_requantize(codec: Codec, codes, header, key=None, *, weight: float):
    """Decodes n chunks, sums them times ``weight`` and re-encodes: the reference's op."""
    fn = resolve("average_requantize", codec, codes, header, weight=weight)
    return fn(codec, codes, header, key, weight=weight)


@dataclasses.dataclass(frozen=True)
class IntegerOps:
    """The integer wire's four ops (``INTEGER_OPS``) for one ``Codec``, each ``resolve``d once,
    where the sync is planned (``sync.config.plan_sync``, which keeps them in the bucket's
    plan): an explicit kernel is refused there. Each takes the ``Codec`` first, as every op
    does (``integer.py``).

    Attributes:
      bounds, encode, factors, decode: ``integer_bounds``, ``integer_encode``,
        ``decode_factors`` and ``integer_decode``.
    """

    bounds: Callable
    encode: Callable
    factors: Callable
    decode: Callable


# --- What the wires compose of the ops, and the checks of their arguments. -----------------


def check_key(stochastic: bool, key, where: str) -> None:
    """Raises unless a key is given exactly for stochastic rounding, naming ``where``."""
    if stochastic and key is None:
        raise ValueError(f"{where}: rounding='stochastic' needs a PRNG key; pass key=...")
    if not stochastic and key is not None:
        raise ValueError(
            f"{where}: a key was given but rounding='nearest' ignores it; "
            "pass rounding='stochastic' to use it"
        )


def resolve_implementation(
    implementation: Implementation | None, platform: str | None = None
) -> Implementation | None:
    """Validates ``implementation``; returns what to dispatch on.

    ``"xla"``, ``"pallas"`` and ``"pallas_interpret"`` come back as they are; None stays None:
    each kernel is then chosen when it is dispatched (``selection.select``). ``"pallas"`` is
    refused here on a mesh of another platform than GPUs (``platform``, where the caller
    knows its mesh: a TPU mesh, say), and on a GPU that Mosaic GPU does not support;
    elsewhere (a CPU host lowering or exporting for CUDA, say) it is lowered as asked, and
    lowering it for a platform other than CUDA raises ``NotImplementedError`` then.

    Args:
      implementation: the name asked for, or None.
      platform: the JAX platform of the mesh the codec runs on (``"tpu"``, ``"gpu"``,
        ``"cpu"``), or None where no mesh is known.

    Raises:
      ValueError: for an unknown implementation.
      NotImplementedError: for ``"pallas"`` on a mesh whose devices are not GPUs, or where
        the default backend is a GPU older than Hopper, or not an NVIDIA one.
    """
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            "implementation must be 'xla', 'pallas', 'pallas_interpret' or None, "
            f"got {implementation!r}"
        )
    if implementation == "pallas" and platform not in (None, "gpu"):
        raise NotImplementedError(
            "implementation='pallas' runs compiled Mosaic GPU kernels, for NVIDIA GPUs of "
            f"compute capability >= 9.0 (Hopper or newer), and this mesh's devices are "
            f"{platform.upper()}s. Pass implementation=None (the best available: XLA's codec "
            f"on {platform.upper()}) or 'xla'; 'pallas_interpret' runs the kernels' bodies in "
            "the Pallas interpreter, for tests"
        )
    if implementation == "pallas" and jax.default_backend() == "gpu" and not pallas.is_supported():
        raise NotImplementedError(
            "implementation='pallas' needs an NVIDIA GPU of compute capability >= 9.0 (Hopper "
            f"or newer); this one is {jax.devices()[0].device_kind!r}. Pass "
            "implementation='xla' (or None for the best available)"
        )
    return implementation


def average_blocks(codec: Codec, codes: jax.Array, header: jax.Array, *, weight: float):
    """Decodes n chunks and sums them times ``weight`` in float32: the fused op's first half.

    ``reference.weighted_sum`` with ``codec``'s decoder: the weight is folded into each
    chunk's scale and the chunks are added in order, as in ``average_requantize``, so a mean
    of values near finfo.max does not overflow.
    """
    decode = functools.partial(dequantize_blocks, codec)
    return reference.weighted_sum(decode, codes, header, weight)


def quantize_with_feedback(
    codec: Codec, x: jax.Array, residual: jax.Array, key: jax.Array | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantizes rows of ``x + residual``; returns codes, header and the new residual.

    Error feedback (Seide et al. 2014; Karimireddy et al., "Error Feedback Fixes SignSGD",
    ICML 2019): what the codes fail to carry this time, ``x + residual - decoded``, is
    carried into the next call, so compression errors cancel over steps instead of piling
    up. ``decoded + new_residual == x + residual`` holds exactly in float32 wherever
    ``x + residual - decoded`` is representable, else to within an ulp. A non-finite block
    makes its residual NaN, as it makes the decoded values NaN.
    """
    target = x + residual
    codes, header = quantize_blocks(codec, target, key)
    decoded = dequantize_blocks(codec, codes, header)
    return codes, header, target - decoded


# --- The scatter-gather wire's stages of the block codec (``wire.scatter_gather_stages``). ---


def _pack(codes: jax.Array, header: jax.Array) -> jax.Array:
    """Each block's codes and header bytes in one uint8 row, so that both go in one message."""
    header_bytes = jax.lax.bitcast_convert_type(header, jnp.uint8)
    return jnp.concatenate([codes, header_bytes.reshape(*header.shape[:-1], -1)], axis=-1)


def _unpack(message: jax.Array, code_bytes: int) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``_pack``: the codes and the float32 header of each row."""
    header_bytes = message[..., code_bytes:].reshape(*message.shape[:-1], HEADER_WIDTH, 4)
    return message[..., :code_bytes], jax.lax.bitcast_convert_type(header_bytes, jnp.float32)


def _piece_keys(key):
    """The two rounding keys of one message piece (its quantize and its requantize)."""
    return (None, None) if key is None else jax.random.split(key)


def sg_encode(x, send, *, key, codec: Codec):
    """The scatter-gather wire's first stage: quantize one piece for its owners.

    ``x`` (and error feedback's ``send`` residual, or None) has shape (peers, blocks,
    block_size): row j goes to peer j. Returns the message, each block's codes with its
    header in one uint8 row, shape (peers, blocks, bytes), and the new ``send`` residual.
    ``codec`` is the plan's ``codecs.Codec``; ``key`` is the piece's key (None for nearest
    rounding).
    """
    peers, blocks, block_size = x.shape
    x = x.reshape(peers * blocks, block_size)
    key = _piece_keys(key)[0]
    if send is None:
        codes, header = quantize_blocks(codec, x, key)
    else:
        send = send.reshape(x.shape)
        codes, header, send = quantize_with_feedback(codec, x, send, key)
        send = send.reshape(peers, blocks, block_size)
    return _pack(codes, header).reshape(peers, blocks, -1), send


def sg_average(received, mean, *, weight, key, codec: Codec, block_size):
    """The second stage: average the received pieces and requantize this device's chunk.

    ``received`` is the all_to_all of ``sg_encode``'s messages, (peers, blocks, bytes);
    ``mean`` error feedback's residual of the requantize, (blocks, block_size), or None.
    Returns the message to gather, (blocks, bytes), and the new ``mean`` residual.
    """
    codes, header = _unpack(received, codec.code_bytes(block_size))
    key = _piece_keys(key)[1]
    if mean is None:
        codes, header = average_requantize(codec, codes, header, key, weight=weight)
    else:
        total = average_blocks(codec, codes, header, weight=weight)
        codes, header, mean = quantize_with_feedback(codec, total, mean, key)
    return _pack(codes, header), mean


def sg_decode(gathered, *, codec: Codec, block_size):
    """The last stage: decode the gathered averages, (peers, blocks, bytes), to float32
    values of shape (peers, blocks, block_size)."""
    peers, blocks = gathered.shape[:2]
    codes, header = _unpack(gathered, codec.code_bytes(block_size))
    decoded = dequantize_blocks(
        codec, codes.reshape(peers * blocks, -1), header.reshape(peers * blocks, -1)
    )
    return decoded.reshape(peers, blocks, block_size)
