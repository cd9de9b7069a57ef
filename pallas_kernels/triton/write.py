"""Pallas cache write by slot mapping, quantize-on-write for every cache dtype (spec §4, §5).

Entry point :func:`write_kv` (called by ``kvjax.write_kv`` after validation). It stores
the same bytes as ``kvjax.reference.cache_update.write_kv`` under ``jax.jit``: the quantizer
arithmetic is written in the form XLA compiles the reference to (reciprocal multiplies, IEEE
division), see :mod:`pallas_kernels.cache_update_math`. (On the H200, XLA-GPU's own compile of
the int8 / int4 per-token-head reference differs from XLA-CPU's in a few bytes, so those two are
exact against the CPU reference only: benchmarks/results/write.md.)

How it works. The physical cache is handed to the kernel whole
(``BlockSpec(memory_space=pl.ANY)``) as a 2-D *row table* (a free reshape of the
contiguous array), aliased to the output (``input_output_aliases``), so under a
``jit`` that donates the cache the write is in place:

- plain, fp8 and per-token-head caches: rows of ``C`` storage elements, one per
  (page, token, head) of NHD (row ``slot*H + h``) or per (page, head, token) of HND
  (row ``(block*H + h)*N + off``); each row is ``[K data | K scale | V data | V scale]``.
- nvfp4 (HND): rows are page sides (row ``2*block + side``), each ``[data (H, N, D/2) |
  scales (H, N, D/16)]``; V scales go to their 4x4-swizzled positions.

One program handles ``tokens_per_program`` tokens: it loads the tokens' slots, loads
their K and V rows, quantizes them in registers and stores each segment with computed
(row, column) indices and a mask. Only rows named by a slot in ``[0, B*N)`` are stored, and
addresses are formed from in-range slots only (int32 never wraps); no other cache byte is
read or written (on GPU masked lanes are not accessed; in interpret mode they point out of
bounds and are dropped). In interpret mode the cache is stored through an unsigned-integer
view: XLA on CPU converts bf16 / fp8 arrays it scatters into through float32, which would
rewrite the NaN payloads of bytes the write does not name. (Compiled Triton stores move the
stored bytes only.) Blocks have power-of-2 sizes: heads,
head sizes and scale groups are padded and masked.
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
from kvjax.slots import int32_slots
from kvjax.spec import KVCacheSpec
from pallas_kernels import common as M

_I32 = jnp.int32
_MAX_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class WriteConfig:
  """Launch parameters of the write kernel (GPU; interpret mode ignores warps/stages).

  :func:`default_config` picks them per format from H200 measurements
  (benchmarks/results/write.md).
  """
  tokens_per_program: int = 1
  num_warps: int = 4
  num_stages: int = 1
  pair_split: bool = False   # int4/nvfp4: load rows contiguously and split even/odd lanes in
                             # registers (True) instead of two stride-2 gathers (False)

  def __post_init__(self):
    tb = self.tokens_per_program
    if tb < 1 or tb & (tb - 1):
      raise ValueError(f"tokens_per_program={tb} must be a power of two")


def default_config(spec: KVCacheSpec) -> WriteConfig:
  """Measured on the H200 (8192 tokens, H=8, D=128): plain / fp8 rows 8 tokens a program;
  quantize-heavy formats 1 token a program with contiguous pair loads."""
  if spec.format.kind in (F.PLAIN, F.FP8_PER_TENSOR):
    return WriteConfig(tokens_per_program=8, num_warps=4)
  return WriteConfig(tokens_per_program=1, num_warps=4, pair_split=True)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static geometry of one write (hashable: closes over the kernel)."""
  kind: str
  quant: object
  qmax: float
  layout: str
  heads: int            # H
  heads_p: int          # H padded to a power of 2
  head_size: int        # D
  block_size: int       # N
  data_dim: int         # storage elements of data in a side row
  padded: int           # storage elements of a side row (scale slot included)
  content: int          # C: storage elements of a row of the row table
  num_rows: int         # rows of the row table
  num_slots: int        # B * N: slots outside [0, num_slots) are dropped
  num_tokens: int       # T
  tb: int               # tokens per program
  storage: np.dtype
  gpu: bool
  pair_split: bool

  @property
  def rows(self) -> int:
    return self.tb * self.heads_p


def _plan(cache, spec: KVCacheSpec, num_tokens: int, config: WriteConfig, gpu: bool) -> _Plan:
  fmt = spec.format
  b = cache.shape[0]
  h, n = spec.num_kv_heads, spec.block_size
  if fmt.kind == F.NVFP4:
    content = h * n * spec.padded_head_size
    num_rows = 2 * b
  else:
    content = spec.content_dim
    num_rows = b * n * h
  if num_rows > _MAX_ROWS:
    raise ValueError(f"cache has {num_rows} rows, more than the kernel's int32 row index allows")
  return _Plan(fmt.kind, fmt.quant, fmt.qmax, spec.layout, h, M.next_pow2(h), spec.head_size, n,
               spec.data_dim, spec.padded_head_size, content, num_rows, b * n, num_tokens,
               config.tokens_per_program, spec.storage_dtype, gpu, config.pair_split)


# -- shared pieces of the kernel body ------------------------------------------------------------
def _token_rows(p: _Plan, slots_ref):
  """Per kernel row r (token r // Hp, head r % Hp): slot, head, validity, source row.

  Valid rows have a slot in ``[0, num_slots)``; every other row gets slot 0, so no address
  is ever formed from an out-of-range slot (no int32 wrap: ``slot * H + h < num_rows``)."""
  r = jnp.arange(p.rows, dtype=_I32)
  tok = pl.program_id(0) * p.tb + r // p.heads_p
  h = r % p.heads_p
  tok_ld = jnp.minimum(tok, p.num_tokens - 1)
  slot = pltriton.load(slots_ref.at[tok_ld])
  valid = (tok < p.num_tokens) & (slot >= 0) & (slot < p.num_slots)
  h_ld = h
  if p.heads_p != p.heads:
    valid = valid & (h < p.heads)
    h_ld = jnp.minimum(h, p.heads - 1)
  return jnp.where(valid, slot, 0), h_ld, valid, tok_ld * p.heads + h_ld


def _cols(n: int, n_valid: int):
  """(store columns, clamped load columns, column mask or None) of a padded segment."""
  c = jnp.arange(n, dtype=_I32)
  if n == n_valid:
    return c, c, None
  return c, jnp.minimum(c, n_valid - 1), c < n_valid


def _load_rows(ref, src_row, cols, dtype=jnp.float32):
  """Gather ``ref[src_row, cols]`` -> ``[rows, len(cols)]`` converted to ``dtype``."""
  shape = (src_row.shape[0], cols.shape[0])
  x = pltriton.load(ref.at[jnp.broadcast_to(src_row[:, None], shape),
                           jnp.broadcast_to(cols[None, :], shape)])
  return x.astype(dtype)


def _load_pairs(p: _Plan, ref, src_row, num_pairs: int, num_cols: int):
  """Even and odd elements ``[rows, num_pairs]`` (float32) of source rows with ``num_cols`` valid
  columns; pairs past the end repeat the last pair (harmless for min / max / amax)."""
  if p.pair_split:
    c = jnp.arange(2 * num_pairs, dtype=_I32)
    if 2 * num_pairs != num_cols:
      c = jnp.minimum(c, num_cols - 1)
    x = _load_rows(ref, src_row, c).reshape(src_row.shape[0], num_pairs, 2)
    even, odd = jnp.split(x, 2, axis=2)
    return even.reshape(even.shape[:2]), odd.reshape(odd.shape[:2])
  j = jnp.arange(num_pairs, dtype=_I32)
  if 2 * num_pairs != num_cols:
    j = jnp.minimum(j, num_cols // 2 - 1)
  return _load_rows(ref, src_row, 2 * j), _load_rows(ref, src_row, 2 * j + 1)


def _store(out_ref, row, col, val, valid, col_mask):
  """Store ``val [rows, n]`` at ``out[row[:, None], col[None, :]]`` where valid (and col_mask)."""
  shape = val.shape
  mask = jnp.broadcast_to(valid[:, None], shape)
  if col_mask is not None:
    mask = mask & jnp.broadcast_to(col_mask[None, :], shape)
  pltriton.store(out_ref.at[jnp.broadcast_to(row[:, None], shape),
                            jnp.broadcast_to(col[None, :], shape)], val, mask=mask)


# -- plain / fp8 / per-token-head rows --------------------------------------------------------
def _encode_side(p: _Plan, mth: M.KernelMath, x_ref, scale_ref, src_row, h_ld, side):
  """Quantize one side of the kernel's rows. Returns [(column offset, cols, mask, values)]."""
  d, dd = p.head_size, p.data_dim
  dp = M.next_pow2(d)
  col, col_ld, cmask = _cols(dp, d)
  if p.kind == F.PLAIN:
    return [(0, col, cmask, _load_rows(x_ref, src_row, col_ld, p.storage))]
  if p.kind == F.FP8_PER_TENSOR:
    x = _load_rows(x_ref, src_row, col_ld)
    s = pltriton.load(scale_ref.at[h_ld + side * p.heads])
    m = float(jnp.finfo(p.storage).max)
    y = jnp.clip(x * mth.recip(s)[:, None], -m, m)
    return [(0, col, cmask, y.astype(p.storage))]
  byte_cols = jnp.arange(4, dtype=_I32)
  if p.quant == "int4":
    dh = dd                                    # D/2 packed bytes
    dhp = M.next_pow2(dh)
    jcol, _, jmask = _cols(dhp, dh)
    xe, xo = _load_pairs(p, x_ref, src_row, dhp, d)
    lo = jnp.minimum(jnp.min(xe, axis=1), jnp.min(xo, axis=1))
    hi = jnp.maximum(jnp.max(xe, axis=1), jnp.max(xo, axis=1))
    scale = quant.int4_scale(lo, hi)
    zp = jnp.clip(M.round_half_even(mth.div(-lo, scale)), 0.0, 15.0)

    r = mth.recip(scale)[:, None]

    def q(v):   # x * (1/scale) + zp: the compiler may contract it into an fma, as XLA's may
      return jnp.clip(M.round_half_even(v * r + zp[:, None]), 0.0, 15.0).astype(jnp.uint8)

    packed = q(xe) | (q(xo) << jnp.uint8(4))
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32)
    bits = (bits & jnp.uint32(0xFFFFFFF0)) | zp.astype(jnp.uint32)
    sbytes = M.f32_to_bytes(jax.lax.bitcast_convert_type(bits, jnp.float32))
    return [(0, jcol, jmask, packed), (dd, byte_cols, None, sbytes)]
  x = _load_rows(x_ref, src_row, col_ld)
  scale = jnp.maximum(M.div_const(jnp.max(jnp.abs(x), axis=1), p.qmax), quant.SCALE_EPS)
  y = x * mth.recip(scale)[:, None]
  if p.quant == np.dtype(np.int8):
    data = jnp.clip(M.round_half_away(y), -128.0, 127.0).astype(jnp.int8)
  else:
    data = M.to_u8(jnp.clip(y, -p.qmax, p.qmax).astype(p.quant))
  sbytes = M.from_u8(M.f32_to_bytes(scale), p.storage)
  return [(0, col, cmask, data), (dd, byte_cols, None, sbytes)]


def _rows_kernel(p: _Plan, slots_ref, k_ref, v_ref, scale_ref, cache_in_ref, out_ref):
  del cache_in_ref  # aliased to out_ref
  mth = M.KernelMath(p.gpu)
  slot, h_ld, valid, src_row = _token_rows(p, slots_ref)
  if p.layout == "NHD":
    row = slot * p.heads + h_ld
  else:
    row = ((slot // p.block_size) * p.heads + h_ld) * p.block_size + slot % p.block_size
  row = jnp.where(valid, row, p.num_rows)       # out of bounds when skipped (interpret mode)
  for side, x_ref in enumerate((k_ref, v_ref)):
    base = side * p.padded
    for off, col, cmask, val in _encode_side(p, mth, x_ref, scale_ref, src_row, h_ld, side):
      val = val.astype(p.storage)
      _store(out_ref, row, base + off + col, val if p.gpu else quant.to_bits(val), valid, cmask)


# -- nvfp4 ------------------------------------------------------------------------------------
def _nvfp4_kernel(p: _Plan, slots_ref, k_ref, v_ref, scale_ref, cache_in_ref, out_ref):
  """Rows of the table are page sides ``[data (H, N, D/2) | scales (H, N, S)]``."""
  del cache_in_ref
  mth = M.KernelMath(p.gpu)
  h, n, d = p.heads, p.block_size, p.head_size
  dh, s = d // 2, d // 16
  sp = M.next_pow2(s)
  slot, h_ld, valid, src_row = _token_rows(p, slots_ref)
  blk, off = slot // n, slot % n
  rows = p.rows
  shape3 = (rows, sp, 8)
  g = jnp.arange(sp, dtype=_I32)
  k8 = jnp.arange(8, dtype=_I32)
  gmask = (g < s) if sp != s else None
  smask = jnp.broadcast_to(valid[:, None], (rows, sp))
  if gmask is not None:
    smask = smask & jnp.broadcast_to(gmask[None, :], (rows, sp))
  dmask = jnp.broadcast_to(smask[:, :, None], shape3)
  tok_row = h_ld * n + off                          # (head, token) row inside a side
  scale_base = h * n * dh
  swizzled = quant.nvfp4_v_scales_swizzled(n, s)
  for side, x_ref in enumerate((k_ref, v_ref)):
    out_row = jnp.where(valid, 2 * blk + side, p.num_rows)
    gs = pltriton.load(scale_ref.at[h_ld + side * h])                     # (rows,)
    xe, xo = (x.reshape(shape3) for x in _load_pairs(p, x_ref, src_row, sp * 8, d))
    amax = jnp.maximum(jnp.max(jnp.abs(xe), axis=2), jnp.max(jnp.abs(xo), axis=2))
    sf = jnp.clip(M.div_const(gs[:, None] * amax, 6.0), 0.0, quant.E4M3_MAX).astype(
        jnp.float8_e4m3fn)
    sf32 = sf.astype(jnp.float32)[:, :, None]
    zero = sf32 == 0.0
    r = mth.recip(jnp.where(zero, 1.0, sf32))
    gs3 = gs[:, None, None]

    def code(v):
      return M.e2m1_encode(jnp.where(zero, 0.0, (v * gs3) * r))

    packed = code(xe) | (code(xo) << jnp.uint8(4))
    data_col = (tok_row[:, None, None] * dh + g[None, :, None] * 8 + k8[None, None, :])
    pltriton.store(out_ref.at[jnp.broadcast_to(out_row[:, None, None], shape3),
                              jnp.broadcast_to(data_col, shape3)], packed, mask=dmask)
    if side == 1 and swizzled:
      q4 = s // 4
      o = off[:, None]
      pos = ((o // 4) * 4 + g[None, :] // q4) * s + (g[None, :] % q4) * 4 + o % 4
      scale_col = scale_base + h_ld[:, None] * (n * s) + pos
    else:
      scale_col = scale_base + tok_row[:, None] * s + g[None, :]
    pltriton.store(out_ref.at[jnp.broadcast_to(out_row[:, None], (rows, sp)),
                              jnp.broadcast_to(scale_col, (rows, sp))], M.to_u8(sf), mask=smask)


# -- entry point --------------------------------------------------------------------------------
def supports_write(spec: KVCacheSpec):
  """Registry hook: the kernel writes every cache format."""
  del spec
  return None


def _global_scales(spec: KVCacheSpec, k_scale, v_scale):
  """float32 ``[2H]``: per-head K then V values the kernel reads (fp8 scales, nvfp4 1/scale)."""
  h = spec.num_kv_heads
  out = []
  for s in (k_scale, v_scale):
    s = jnp.asarray(1.0 if s is None else s, jnp.float32)
    if spec.format.kind == F.NVFP4:
      s = 1.0 / s.reshape(())                      # the same op as quant.quantize_nvfp4
    out.append(jnp.broadcast_to(s.reshape(-1) if s.ndim else s, (h,)))
  return jnp.concatenate(out)


def write_kv(cache, key, value, slot_mapping, spec: KVCacheSpec, *, k_scale=None, v_scale=None,
             interpret=False, config: WriteConfig | None = None):
  """Write ``key``/``value`` rows into ``cache`` at ``slot_mapping``; returns the new cache.

  Args:
    cache: the spec's physical array (NHD ``(B, N, H, C)``, HND ``(B, H, N, C)``).
    key, value: ``[T', H, D]`` in ``spec.dtype``; the first ``T = len(slot_mapping)`` are written.
    slot_mapping: int ``[T]``, ``block * N + offset``; negative slots are skipped.
    k_scale, v_scale: fp8 per-tensor scales (scalar or ``[H]``) or nvfp4 global scales.
    interpret: run the kernel in Pallas interpret mode (CPU); else the Triton lowering.
    config: :class:`WriteConfig` (tokens per program, warps); None = :func:`default_config`.
  Same stored bytes as ``kvjax.reference.cache_update.write_kv``. In place when the
  caller's ``jit`` donates ``cache``.
  """
  config = config or default_config(spec)
  t = int(slot_mapping.shape[0])
  if t == 0:
    return cache
  p = _plan(cache, spec, t, config, gpu=not interpret)
  h, d = spec.num_kv_heads, spec.head_size
  k2 = key.reshape(key.shape[0] * h, d)
  v2 = value.reshape(value.shape[0] * h, d)
  slots = int32_slots(slot_mapping, p.num_slots)
  scales = _global_scales(spec, k_scale, v_scale)
  table = cache.reshape(p.num_rows, p.content)
  if interpret:     # interpret mode stores through XLA scatters: move bits, never floats
    table = quant.to_bits(table)
  body = _nvfp4_kernel if p.kind == F.NVFP4 else _rows_kernel
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  extra = {}
  if not interpret:
    extra["compiler_params"] = pltriton.CompilerParams(num_warps=config.num_warps,
                                                       num_stages=config.num_stages)
  out = pl.pallas_call(
      functools.partial(body, p),
      out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
      grid=(pl.cdiv(t, p.tb),),
      in_specs=[any_spec] * 5,
      out_specs=any_spec,
      input_output_aliases={4: 0},
      interpret=interpret,
      name=f"write_kv_{spec.cache_dtype}_{spec.layout}",
      **extra,
  )(slots, k2, v2, scales, table)
  return quant.from_bits(out, cache.dtype).reshape(cache.shape)
