"""The width vocabulary: what each code width is, in one table, and the names users pass.

A width (``bits``) is one ``Format``: how many codes share a byte, how many levels a block
has, its default and smallest block, whether Pallas kernels exist for it, whether
``wire="auto"`` sums its codes on the integer wire, and whether its codes are coarse enough
that QAdam's second moment should follow the momentum. Every place outside the codecs asks
the format (through ``codecs.Codec``) instead of testing ``bits`` by value, so a new width is
one row of ``FORMATS`` (and, for the integer wire, one of ``integer.MAX_GROUP``).

Codes narrower than a byte are packed ``per_byte`` to a byte, a block's parts side by side:
byte j of a block holds value j + i * (block_size / per_byte) at bit i * bits
(``reference.pack``), so a kernel holding a block as rows of 128 lanes packs with whole-row
slices.
"""

import dataclasses
import types
from typing import Literal

from jax_bytegrad._src import checks

Bits = Literal[8, 4, 2]
Rounding = Literal["nearest", "stochastic"]
ROUNDINGS = ("nearest", "stochastic")
# Kernels tile a block's (packed) codes as whole rows of 128 bytes.
MIN_BLOCK_SIZE = 128


@dataclasses.dataclass(frozen=True)
class Format:
    """One code width: everything about ``bits`` that the rest of the library asks.

    Attributes:
      bits: bits per code.
      block_size: the default values per block ("4-bit block size" in benchmarks/RESULTS.md;
        2 bits take the smallest block their packing allows: 4 levels need small blocks).
      auto_allreduce_group: the largest group whose codes ``wire="auto"`` sums on the
        integer wire; 0 for never (the scatter-gather wire then).
      kernels: whether Pallas kernels exist for this width (``codecs/pallas.py``).
      coarse: whether the codes' error is large enough to swell Adam's second moment
        (QAdam then follows the momentum's: docs/qadam.md).
    """

    bits: int
    block_size: int
    auto_allreduce_group: int
    kernels: bool
    coarse: bool

    @property
    def per_byte(self) -> int:
        """Codes per byte."""
        return 8 // self.bits

    @property
    def levels(self) -> int:
        """The largest code, ``2**bits - 1``."""
        return 2**self.bits - 1

    @property
    def smallest_block(self) -> int:
        """The smallest block: 128 bytes of packed codes."""
        return MIN_BLOCK_SIZE * self.per_byte

    def code_bytes(self, block_size: int) -> int:
        """Bytes of packed codes in a block of ``block_size`` values (its header aside)."""
        return block_size // self.per_byte

    def check_block_size(self, block_size, where: str) -> int:
        """Validates ``block_size``; returns it, or this width's default for None."""
        if block_size is None:
            return self.block_size
        smallest = self.smallest_block
        if not checks.is_int(block_size) or block_size < smallest or block_size & (block_size - 1):
            packing = ""
            if self.per_byte > 1:
                packing = f" for {self.bits}-bit codes ({self.per_byte} per byte, 128 bytes)"
            raise ValueError(
                f"{where}: block_size must be a power of two >= {smallest}, got "
                f"{block_size!r}{packing}"
            )
        return int(block_size)


# Every width, widest first (the order of ``BITS``, and so of error messages).
FORMATS = types.MappingProxyType(
    {
        8: Format(8, block_size=1024, auto_allreduce_group=8, kernels=True, coarse=False),
        4: Format(4, block_size=512, auto_allreduce_group=0, kernels=True, coarse=True),
        2: Format(2, block_size=512, auto_allreduce_group=0, kernels=False, coarse=True),
    }
)
BITS = tuple(FORMATS)
# Elements per quantization block, per code width. Read-only: every default in the library
# reads it, so a write would change them all at once.
DEFAULT_BLOCK_SIZES = types.MappingProxyType({b: f.block_size for b, f in FORMATS.items()})


def format_of(bits: int, where: str = "jax_bytegrad") -> Format:
    """The ``Format`` of ``bits``.

    Raises:
      ValueError: for a width that has none, naming the ones there are.
    """
    checks.one_of(bits, BITS, "bits", where)
    return FORMATS[bits]


def check_block_size(block_size, where: str, bits: int = 8) -> int:
    """Validates ``block_size`` for ``bits``; returns it, or the default for None."""
    return format_of(bits, where).check_block_size(block_size, where)
