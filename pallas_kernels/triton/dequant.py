"""Pallas dequantize kernels for cache pages of every cache dtype (int4, nvfp4, fp8, int8, plain).

:func:`dequantize_pages` equals ``kvjax.views.dequantize_pages`` (float32, same bits). It
reads the split data / scale views straight from the packed page bytes:

- per-token-head: each (token, head) row ``[K data | K scale | V data | V scale]``; the
  float32 scale is rebuilt from its 4 bytes with shifts (int4: zero point in its low
  4 mantissa bits);
- nvfp4 (HND): per page side ``[data (H, N, D/2) | e4m3 scales (H, N, D/16)]``, V scales
  read from their 4x4-swizzled positions; e2m1 nibbles unpacked with uint8 shifts.

One program per (page, head) writes that head's N tokens of K and V.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvjax import formats as F
from kvjax import quant
from kvjax.spec import KVCacheSpec
from pallas_kernels import common as M

_I32 = jnp.int32


@dataclasses.dataclass(frozen=True)
class _Plan:
  kind: str
  quant: object
  layout: str
  pages: int            # P
  heads: int            # H
  head_size: int        # D
  block_size: int       # N
  data_dim: int
  padded: int
  content: int          # elements of a row of the input table
  storage: np.dtype


def _rows_and_cols(n: int, n_valid: int):
  c = jnp.arange(n, dtype=_I32)
  return c, (c < n_valid) if n != n_valid else None


def _dequant_kernel(p: _Plan, table_ref, scale_ref, k_ref, v_ref):
  """Non-nvfp4 pages. table_ref: ``[P*N*H, C]`` storage rows; outputs ``[P*N*H, D]`` float32."""
  pg, h = pl.program_id(0), pl.program_id(1)
  n, d, dd = p.block_size, p.head_size, p.data_dim
  npad = M.next_pow2(n)
  t, tmask = _rows_and_cols(npad, n)
  t_ld = jnp.minimum(t, n - 1) if tmask is not None else t
  if p.layout == "NHD":
    in_row = (pg * n + t_ld) * p.heads + h
  else:
    in_row = (pg * p.heads + h) * n + t_ld
  out_row = (pg * n + t_ld) * p.heads + h
  num_out = p.pages * n * p.heads
  if tmask is not None:
    out_row = jnp.where(tmask, out_row, num_out)

  def load(cols):                                   # (npad,), (m,) -> (npad, m) storage
    shape = (npad, cols.shape[0])
    return pltriton.load(table_ref.at[jnp.broadcast_to(in_row[:, None], shape),
                                      jnp.broadcast_to(cols[None, :], shape)])

  def store(ref, cols, cmask, val):
    shape = val.shape
    mask = None
    if tmask is not None:
      mask = jnp.broadcast_to(tmask[:, None], shape)
    if cmask is not None:
      cm = jnp.broadcast_to(cmask[None, :], shape)
      mask = cm if mask is None else mask & cm
    pltriton.store(ref.at[jnp.broadcast_to(out_row[:, None], shape),
                          jnp.broadcast_to(cols[None, :], shape)], val, mask=mask)

  def row_scale(base):                              # float32 (npad,) from 4 storage bytes
    b = [M.to_u8(load(jnp.full((1,), base + i, _I32)))[:, 0] for i in range(4)]
    return M.bytes_to_u32(*b)

  for side, out_ref in enumerate((k_ref, v_ref)):
    base = side * p.padded
    if p.quant == "int4":
      dh = dd
      dhp = M.next_pow2(dh)
      j, jmask = _rows_and_cols(dhp, dh)
      j_ld = jnp.minimum(j, dh - 1) if jmask is not None else j
      packed = load(base + j_ld)
      bits = row_scale(base + dd)
      zp = (bits & jnp.uint32(0xF)).astype(jnp.float32)[:, None]
      s = jax.lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFFFF0), jnp.float32)[:, None]
      lo = (packed & jnp.uint8(0xF)).astype(jnp.float32)
      hi = (packed >> jnp.uint8(4)).astype(jnp.float32)
      store(out_ref, 2 * j, jmask, (lo - zp) * s)
      store(out_ref, 2 * j + 1, jmask, (hi - zp) * s)
      continue
    dp = M.next_pow2(d)
    c, cmask = _rows_and_cols(dp, d)
    c_ld = jnp.minimum(c, d - 1) if cmask is not None else c
    q = load(base + c_ld)
    if p.kind == F.PLAIN:
      x = q.astype(jnp.float32)
    elif p.kind == F.FP8_PER_TENSOR:
      s = pltriton.load(scale_ref.at[jnp.full((1,), side * p.heads + h, _I32)])
      x = q.astype(jnp.float32) * s[:, None]
    else:
      scale = jax.lax.bitcast_convert_type(row_scale(base + dd), jnp.float32)[:, None]
      if p.quant == np.dtype(np.int8):
        qf = q.astype(jnp.float32)
      else:
        qf = M.from_u8(M.to_u8(q), p.quant).astype(jnp.float32)
      x = qf * scale
    store(out_ref, c, cmask, x)


def _nvfp4_kernel(p: _Plan, table_ref, scale_ref, k_ref, v_ref):
  """nvfp4 pages. table_ref: ``[2P, H*N*F]`` page sides; outputs ``[P*N*H, D]`` float32."""
  pg, h = pl.program_id(0), pl.program_id(1)
  heads, n, d = p.heads, p.block_size, p.head_size
  dh, s = d // 2, d // 16
  npad, dhp = M.next_pow2(n), M.next_pow2(dh)
  t, tmask = _rows_and_cols(npad, n)
  t_ld = jnp.minimum(t, n - 1) if tmask is not None else t
  j, jmask = _rows_and_cols(dhp, dh)
  j_ld = jnp.minimum(j, dh - 1) if jmask is not None else j
  shape = (npad, dhp)
  out_row = (pg * n + t_ld) * heads + h
  if tmask is not None:
    out_row = jnp.where(tmask, out_row, p.pages * n * heads)
  mask = None
  if tmask is not None:
    mask = jnp.broadcast_to(tmask[:, None], shape)
  if jmask is not None:
    jm = jnp.broadcast_to(jmask[None, :], shape)
    mask = jm if mask is None else mask & jm
  tt = t_ld[:, None]
  grp = (j_ld // 8)[None, :]
  scale_base = heads * n * dh
  swizzled = quant.nvfp4_v_scales_swizzled(n, s)
  for side, out_ref in enumerate((k_ref, v_ref)):
    row = jnp.broadcast_to(2 * pg + side, shape)
    data_col = (h * n + tt) * dh + j_ld[None, :]
    if side == 1 and swizzled:
      q4 = s // 4
      pos = ((tt // 4) * 4 + grp // q4) * s + (grp % q4) * 4 + tt % 4
      scale_col = scale_base + h * (n * s) + pos
    else:
      scale_col = scale_base + (h * n + tt) * s + grp
    packed = pltriton.load(table_ref.at[row, jnp.broadcast_to(data_col, shape)])
    sf_raw = pltriton.load(table_ref.at[row, jnp.broadcast_to(scale_col, shape)])
    sf = M.from_u8(sf_raw, jnp.float8_e4m3fn).astype(jnp.float32)
    gscale = pltriton.load(scale_ref.at[jnp.full((1,), side * heads + h, _I32)])[:, None]
    lo = (M.e2m1_decode(packed & jnp.uint8(0xF)) * sf) * gscale
    hi = (M.e2m1_decode(packed >> jnp.uint8(4)) * sf) * gscale
    for parity, val in ((0, lo), (1, hi)):
      col = jnp.broadcast_to((2 * j + parity)[None, :], shape)
      pltriton.store(out_ref.at[jnp.broadcast_to(out_row[:, None], shape), col], val, mask=mask)


def _scales(spec: KVCacheSpec, k_scale, v_scale):
  """float32 ``[2H]``: K then V per-head global scales (1.0 when None)."""
  h = spec.num_kv_heads
  out = []
  for s in (k_scale, v_scale):
    s = jnp.asarray(1.0 if s is None else s, jnp.float32)
    out.append(jnp.broadcast_to(s.reshape(-1) if s.ndim else s, (h,)))
  return jnp.concatenate(out)


def supports_read(spec: KVCacheSpec):
  """Registry hook: the kernel dequantizes every cache format."""
  del spec
  return None


def dequantize_pages(pages, spec: KVCacheSpec, k_scale=None, v_scale=None, *, interpret=False,
                     num_warps: int = 4):
  """Dequantized (K, V), float32 ``[P..., N, H, D]``, of physical pages ``[P..., *page]``.

  Same values (bit for bit) as ``kvjax.views.dequantize_pages``. ``k_scale``/``v_scale``:
  fp8 per-tensor scales (scalar or ``[H]``) or nvfp4 global scales (scalar). The ``read``
  implementation "pallas" of ``kvjax.read_kv`` (arguments validated there).
  """
  fmt = spec.format
  lead = tuple(pages.shape[:-3])
  num_pages = int(np.prod(lead))
  h, n, d = spec.num_kv_heads, spec.block_size, spec.head_size
  out_shape = lead + (n, h, d)
  if num_pages == 0:
    z = jnp.zeros(out_shape, jnp.float32)
    return z, z
  if fmt.kind == F.NVFP4:
    content = h * n * spec.padded_head_size
    table = pages.reshape(2 * num_pages, content)
    body = _nvfp4_kernel
  else:
    content = spec.content_dim
    table = pages.reshape(num_pages * n * h, content)
    body = _dequant_kernel
  p = _Plan(fmt.kind, fmt.quant, spec.layout, num_pages, h, d, n, spec.data_dim,
            spec.padded_head_size, content, spec.storage_dtype)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  extra = {}
  if not interpret:
    extra["compiler_params"] = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
  out = jax.ShapeDtypeStruct((num_pages * n * h, d), jnp.float32)
  k, v = pl.pallas_call(
      functools.partial(body, p),
      out_shape=(out, out),
      grid=(num_pages, h),
      in_specs=[any_spec, any_spec],
      out_specs=(any_spec, any_spec),
      interpret=interpret,
      name=f"dequantize_pages_{spec.cache_dtype}",
      **extra,
  )(table, _scales(spec, k_scale, v_scale))
  return k.reshape(out_shape), v.reshape(out_shape)
