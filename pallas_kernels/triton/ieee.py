"""IEEE float32 division inside Triton kernels (XLA divides with IEEE rounding).

Triton lowers ``/`` to ``div.full.f32`` (approximate, up to 2 ulp). Where a kernel must store
the bits the reference stores (quantize-on-write), it divides with :class:`Divider`, which
emits ``div.rn.f32`` under the Triton lowering and a plain ``/`` in interpret mode.
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

  def recip(self, s):
    """``1 / s`` rounded to nearest (what XLA hoists out of ``x / broadcast(s)``)."""
    return self.div(jnp.ones_like(s), s)
