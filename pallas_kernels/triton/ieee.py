"""Exact float32 arithmetic inside Triton kernels: IEEE division, one-instruction conversions.

Triton lowers ``/`` to ``div.full.f32`` (approximate, up to 2 ulp). Where a kernel must store
the bits the reference stores (quantize-on-write), it divides with :class:`Divider`, which
emits ``div.rn.f32`` under the Triton lowering and a plain ``/`` in interpret mode. Its
:meth:`Divider.trunc_u32` converts without the NaN-propagating range clamps JAX's lowering of
``astype`` adds (three extra instructions a value), for values already in range.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Divider:
  """``compiled=True`` under the Triton lowering, False in interpret mode."""
  compiled: bool

  def div(self, x, y):
    """IEEE round-to-nearest float32 ``x / y`` (same bits as XLA's divide)."""
    x = jnp.asarray(x, jnp.float32)
    y = jnp.asarray(y, jnp.float32)
    if not self.compiled:
      return x / y
    from jax.experimental.pallas import triton as pltriton
    shape = jnp.broadcast_shapes(x.shape, y.shape)
    x, y = jnp.broadcast_to(x, shape), jnp.broadcast_to(y, shape)
    [out] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[x, y], constraints="=f,f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(shape, jnp.float32)])
    return out

  def trunc_u32(self, x):
    """float32 ``x`` below ``2**32`` -> uint32 rounded toward zero, negative values (and NaN)
    to 0: PTX's float -> integer conversions saturate (``astype``'s value in range)."""
    if not self.compiled:
      return jnp.where(x > 0, x, 0.0).astype(jnp.uint32)
    from jax.experimental.pallas import triton as pltriton
    [out] = pltriton.elementwise_inline_asm(   # Triton's inline asm returns signless ints
        "cvt.rzi.u32.f32 $0, $1;", args=[x], constraints="=r,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.int32)])
    return jax.lax.bitcast_convert_type(out, jnp.uint32)

  def recip(self, s):
    """``1 / s`` rounded to nearest (what XLA hoists out of ``x / broadcast(s)``)."""
    return self.div(jnp.ones_like(s), s)
