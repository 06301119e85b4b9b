"""The grid of a block, one rule for every codec: its scale and zero point from its bounds.

Follows the min-max grid of Bagua's ByteGrad (Gan et al., "Bagua: Scaling up Distributed
Learning with System Relaxations", VLDB 2022), stored as (scale, zero point) so that zero is
exact. For a block with lo = min, hi = max and L levels (the largest code), with D = L steps
for nearest rounding and L - 1 for stochastic rounding:

    scale = max((hi - lo) / D, max(|lo|, |hi|) * 2**-23)
    zero  = round(-lo / scale) (nearest)      ceil(-lo / scale) (stochastic)
    code  = clip(round(y) + zero, 0, L)                          y = x / scale (nearest)
            clip(floor(y) + (u < y - floor(y)) + zero, 0, L), u ~ U[0, 1) (stochastic)
    x_hat = clip((code - zero) * scale, -finfo.max, finfo.max)

A constant block (lo == hi) gets scale = lo and zero = -1, so codes 0 decode to exactly lo; a
block with a non-finite bound gets scale = NaN and zero = 0, so it decodes to NaN. Why each
piece: ``reference.py`` (the min-max codec) and ``integer.py`` (the integer wire's).

Every codec computes this rule through ``grid`` and ``codes`` below: its operations and their
order are written once. Only a few are spelled differently (``Spelling``): Mosaic GPU lowers no
``floor``, ``ceil`` or ``isfinite``, so ``pallas.py`` spells them with ops it lowers, exactly
(the same bits as jnp's); and the range step ``(hi - lo) / D``, written so that +-3e38 in one
block does not overflow, has two forms: ``split_step`` here (the min-max codec's), and the
integer wire's, in which no product feeds an add (``integer.py``).
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

# Keeps |zero| <= 2**23 so that code - zero is an exact float32 integer.
SCALE_FLOOR = 2.0**-23
F32_MAX = float(np.finfo(np.float32).max)


def max_code(bits: int) -> float:
    """The largest code of a ``bits``-wide grid: 255 or 15."""
    return float(2**bits - 1)


def split_step(lo: jax.Array, hi: jax.Array, steps) -> jax.Array:
    """``(hi - lo) / steps`` as ``hi / steps - lo / steps``: no overflow at +-3e38."""
    return hi / steps - lo / steps


@dataclasses.dataclass(frozen=True)
class Spelling:
    """The operations of the grid whose spelling differs between codecs; the values agree.

    Attributes:
      floor, ceil, isfinite: ``jnp``'s, or exact spellings from ops Mosaic GPU lowers.
      step: the range step ``(hi - lo) / D`` of bounds ``lo``, ``hi`` and ``D`` steps.
    """

    floor: Callable = jnp.floor
    ceil: Callable = jnp.ceil
    isfinite: Callable = jnp.isfinite
    step: Callable = split_step


XLA = Spelling()


def grid(lo, hi, *, levels, stochastic: bool, spelling: Spelling = XLA):
    """Scale, zero point and 1 / scale of blocks with bounds ``lo`` and ``hi``.

    Args:
      lo, hi: each block's min and max (float32, any matching shapes).
      levels: L, the largest code.
      stochastic: the grid of stochastic rounding (D = L - 1 steps, zero rounded up), else
        of nearest rounding (D = L, zero rounded to nearest).
      spelling: how the few operations that differ between codecs are written.

    Returns:
      ``(scale, zero, inv_scale)``; ``inv_scale`` is 0 for constant and non-finite blocks,
      whose codes are then all ``zero``'s clip (see the module docstring).
    """
    steps = levels - 1 if stochastic else levels
    magnitude = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
    scale = jnp.maximum(spelling.step(lo, hi, steps), magnitude * SCALE_FLOOR)
    inv_scale = jnp.where(scale > 0, 1.0 / scale, 0.0)
    shift = -lo * inv_scale
    zero = spelling.ceil(shift) if stochastic else jnp.round(shift)
    constant = hi == lo
    scale = jnp.where(constant, lo, scale)
    zero = jnp.where(constant, -1.0, zero)
    finite = spelling.isfinite(lo) & spelling.isfinite(hi)
    scale = jnp.where(finite, scale, jnp.nan)
    zero = jnp.where(finite, zero, 0.0)
    inv_scale = jnp.where(finite & ~constant, inv_scale, 0.0)
    return scale, zero, inv_scale


def codes(y, zero, levels, uniforms=None, floor: Callable = jnp.floor):
    """The codes of values ``y`` given in steps of the grid (``x * inv_scale``), as float32
    integers in [0, ``levels``]: rounded to nearest, or stochastically against ``uniforms``.

    Stochastic rounding compares ``u`` with the exact fraction of ``y`` rather than flooring
    ``y + u``: unbiased even where |y| nears 2**23 and float32 has no room for ``u``.
    """
    if uniforms is None:
        y = jnp.round(y)
    else:
        down = floor(y)
        y = down + (uniforms < y - down).astype(jnp.float32)
    # Non-finite x gives NaN here; those blocks have zero = 0 and decode to NaN via the scale.
    y = jnp.where(jnp.isnan(y), 0.0, y)
    return jnp.clip(y + zero, 0.0, levels)


def decode(codes, zero, scale):
    """The values of float32 ``codes`` on the grid: one rounded product, kept finite."""
    return jnp.clip((codes - zero) * scale, -F32_MAX, F32_MAX)
