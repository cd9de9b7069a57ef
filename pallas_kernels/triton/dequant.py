"""Triton dequantize kernel: cache pages of any format -> float32 K and V.

The "pallas" implementation of the read op (``kvjax.registry.READ``, used by
``kvjax.read_kv``). Same values, bit for bit, as the reference
(``kvjax.views.dequantize_stored``): both run the format's :mod:`kvjax.quant` formulas, the
kernel through the format's tile hooks (:mod:`pallas_kernels.triton.formats`).

One program per (page, head) loads that head's N tokens of K and V, dequantizes them in
registers and stores them token-major.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvjax.codecs import RowAddress
from kvjax.spec import KVCacheSpec
from pallas_kernels.common import next_pow2
from pallas_kernels.triton.adapters import hooks_reason, tile_format
from pallas_kernels.triton.formats import TileFormat

_I32 = jnp.int32


def supports_read(spec: KVCacheSpec):
  """Registry hook: every format the Triton adapter table adapts."""
  return hooks_reason(spec)


def _kernel(fmt: TileFormat, pages_ref, scale_ref, k_ref, v_ref):
  """pages_ref: ``[P, page_elems]``; scale_ref: float32 ``[2, H]``; outputs ``[P*N*H, D]``."""
  pg, h = pl.program_id(0), pl.program_id(1)
  n, d = fmt.block_size, fmt.head_size
  t = jnp.arange(next_pow2(n), dtype=_I32)
  valid = t < n
  tok = jnp.minimum(t, n - 1)
  tiles = fmt.load_kv(pages_ref, jnp.full(t.shape, pg, _I32), tok, h, valid)
  out = RowAddress(False, fmt.num_heads, n, d)              # token-major output rows
  row = jnp.where(valid, out.row(pg, tok, h), pl.num_programs(0) * n * fmt.num_heads)
  scales = (scale_ref[0, h], scale_ref[1, h])
  for o_ref, parts in zip((k_ref, v_ref), fmt.dequant(tiles, *scales)):
    for j, x in enumerate(parts):
      cols, cmask = fmt.part_cols(j)
      shape = x.shape
      pltriton.store(o_ref.at[jnp.broadcast_to(row[:, None], shape),
                              jnp.broadcast_to(cols[None, :], shape)], x,
                     mask=jnp.broadcast_to(valid[:, None] & cmask[None, :], shape))


def dequantize_pages(pages, spec: KVCacheSpec, k_scale=None, v_scale=None, *, interpret=False,
                     num_warps: int = 4):
  """Dequantized (K, V), float32 ``[P..., N, H, D]``, of physical pages ``[P..., *page]``.

  Same values (bit for bit) as ``kvjax.views.dequantize_stored``. ``k_scale``/``v_scale``:
  fp8 per-tensor scales (scalar or ``[H]``) or nvfp4 global scales (scalar). Arguments
  arrive validated by ``kvjax.read_kv``.
  """
  lead = tuple(pages.shape[:-3])
  num_pages = 1
  for x in lead:
    num_pages *= x
  h, n, d = spec.num_kv_heads, spec.block_size, spec.head_size
  out_shape = lead + (n, h, d)
  if num_pages == 0:
    z = jnp.zeros(out_shape, jnp.float32)
    return z, z
  fmt = tile_format(spec)
  params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
  out = jax.ShapeDtypeStruct((num_pages * n * h, d), jnp.float32)
  k, v = pl.pallas_call(
      functools.partial(_kernel, fmt),
      out_shape=(out, out),
      grid=(num_pages, h),
      in_specs=[pl.BlockSpec(memory_space=pl.ANY)] * 2,
      out_specs=(pl.BlockSpec(memory_space=pl.ANY),) * 2,
      compiler_params=params,
      interpret=interpret,
      name=f"dequantize_pages_{spec.cache_dtype}",
  )(pages.reshape(num_pages, fmt.page_elems), fmt.tensor_scales(k_scale, v_scale))
  return k.reshape(out_shape), v.reshape(out_shape)
