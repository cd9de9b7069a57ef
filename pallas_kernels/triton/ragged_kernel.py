"""Ragged paged attention, Pallas kernel for the Triton lowering (GPU) and interpret mode.

One program per (KV head h, query tile). A query tile is ``bq`` consecutive
query tokens of one sequence times the ``G = Hq / H`` query heads that share KV
head h: ``rows = bq * G`` (padded to a power of two) rows of one tensor-core
tile, so every K/V load serves all G heads. The program walks its sequence's
keys in tiles of ``block_kv`` tokens gathered through the block table (any
block size, any page order), online softmax in float32 (exp2 domain), scores
``q @ k.T`` and ``p @ v`` as float32-accumulated ``lax.dot_general`` on the
tensor cores (16-bit operands; float32 when q is float32). Key tiles fully
visible to every row of the query tile run without masks; only the tiles that
cross the causal diagonal, the window edge or the sequence end are masked.

The cache is read in place: for row formats the physical array is viewed as rows
``[B*N*H, C]`` (NHD) or ``[B*H*N, C]`` (HND), a free reshape, and each key tile loads the K
half and the V half of the same rows back to back (:class:`_RowTiles`); fp8 scales fold into
the score scale / the output, per-token-head scales come from the row's 4 scale bytes, per
key column. Formats whose kernels keep even and odd head dims apart (int4, nvfp4) load
through their tile hooks over pages ``[B, page_elems]`` (:class:`_PageTiles`). Which
applies, and the per-format math, are the format's hooks (:mod:`pallas_kernels.triton.formats`).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvjax import ragged_batch as RB
from pallas_kernels.common import f32_from_bytes
from pallas_kernels.triton.formats import TileFormat

_LOG2E = math.log2(math.e)
_M_INIT = -1e30   # running max before any key: finite, so exp2(m_old - m_new) is never NaN


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Tile sizes and Triton launch parameters (static).

  rows: query rows per program (bq * G padded up), a power of two >= 16.
  block_kv: keys per inner step, a power of two >= 16.
  """
  rows: int = 128
  block_kv: int = 64
  num_warps: int = 8
  num_stages: int = 3

  def __post_init__(self):
    for name in ("rows", "block_kv"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name}={v} must be a power of two >= 16")


@dataclasses.dataclass(frozen=True)
class KernelStatics:
  """Everything static the kernel body needs."""
  fmt: TileFormat            # the cache format's hooks (geometry, compute dtype)
  head_pad: int              # power of two >= D
  group: int                 # G = Hq / H
  num_blocks: int            # B
  max_blocks: int            # block_table.shape[1]
  num_tiles: int             # static grid size along query tiles
  bq: int                    # query tokens per tile
  rows: int
  block_kv: int
  causal: bool
  window: Optional[int]
  soft_cap: Optional[float]
  has_sinks: bool
  scale: Optional[float]     # softmax scale; None = traced, read from k_scale_h[H]
  array_cols: bool = False   # index columns with arrays (interpret mode: no mixed slice+array)
  scale_words: bool = False  # row scales read from a float32 view of the rows (words_ref)

  @property
  def head_size(self) -> int:
    return self.fmt.head_size

  @property
  def num_kv_heads(self) -> int:
    return self.fmt.num_heads

  @property
  def block_size(self) -> int:
    return self.fmt.block_size


def _dot(st: KernelStatics, a, b, contract):
  """float32-accumulated 2-D dot on the tensor cores: ``a [M, K]`` with b contracted on dim
  ``contract[1]`` (1: ``a @ b.T``, 0: ``a @ b``), at the format's precision."""
  return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                         precision=st.fmt.precision, preferred_element_type=jnp.float32)


def _cols(st: KernelStatics, base: int, clamp: bool = True):
  """Column index of a (rows, head_pad) access at ``base``: a slice when D is a power of two
  (compiled), else column indices plus a mask. Loads clamp padded columns (every address in
  bounds); stores leave them out of range so masked lanes never alias a real element."""
  if st.head_pad == st.head_size and not st.array_cols:
    return pl.ds(base, st.head_size), None
  c = jnp.arange(st.head_pad, dtype=jnp.int32)
  col_mask = None if st.head_pad == st.head_size else c < st.head_size
  return base + (jnp.minimum(c, st.head_size - 1) if clamp else c), col_mask


def _load_rows(ref, rows, st: KernelStatics, base: int, row_mask=None):
  """``ref[rows, base:base+D]`` as ``[len(rows), head_pad]`` in the compute dtype (K/V data
  dequantized up to its scale); masked rows/cols read 0."""
  cols, col_mask = _cols(st, base)
  if not isinstance(cols, jax.Array):
    idx = (rows, cols)
    mask = None if row_mask is None else row_mask[:, None]
  else:
    idx = tuple(jnp.broadcast_arrays(rows[:, None], cols[None, :]))
    mask = col_mask[None, :] if col_mask is not None else None
    if row_mask is not None:
      mask = row_mask[:, None] if mask is None else row_mask[:, None] & mask
  if mask is None:
    return st.fmt.to_compute(pltriton.load(ref.at[idx]))
  mask = jnp.broadcast_to(mask, (rows.shape[0], st.head_pad))
  if jnp.dtype(ref.dtype).itemsize == 1 and jnp.issubdtype(ref.dtype, jnp.floating):
    # fp8 storage: the Triton lowering cannot cast an `other` constant to fp8, so zero the
    # masked lanes after converting (a select, so poison bits never propagate).
    x = st.fmt.to_compute(pltriton.load(ref.at[idx], mask=mask))
    return jnp.where(mask, x, jnp.zeros((), x.dtype))
  return st.fmt.to_compute(pltriton.load(ref.at[idx], mask=mask, other=0))


def _store_rows(ref, rows, val, st: KernelStatics, row_mask):
  cols, col_mask = _cols(st, 0, clamp=False)
  mask = row_mask[:, None]
  if not isinstance(cols, jax.Array):
    idx = (rows, cols)
  else:
    idx = tuple(jnp.broadcast_arrays(rows[:, None], cols[None, :]))
    if col_mask is not None:
      mask = mask & col_mask[None, :]
  pltriton.store(ref.at[idx], val, mask=jnp.broadcast_to(mask, val.shape))


def _row_scale(cache_ref, rows, col: int, row_mask, words_ref=None):
  """float32 per-token-head scale from the 4 storage bytes at ``col..col+3`` of each row (or,
  with ``words_ref``, the float32 view ``[R, C/4]`` of the rows: word ``col / 4``)."""
  if words_ref is not None:
    idx = words_ref.at[rows, col // 4]
    return pltriton.load(idx) if row_mask is None else pltriton.load(idx, mask=row_mask,
                                                                      other=0.0)
  if row_mask is None:
    return f32_from_bytes(lambda i: pltriton.load(cache_ref.at[rows, col + i]))
  return f32_from_bytes(
      lambda i: pltriton.load(cache_ref.at[rows, col + i], mask=row_mask, other=0))


def _softmax_scale(st: KernelStatics, ks_ref):
  """The softmax scale: static, or (traced) loaded from the element after the H k scales."""
  return st.scale if st.scale is not None else ks_ref[st.num_kv_heads]


class _RowTiles:
  """K/V tiles as rows of the physical cache ``[R, C]`` (row formats: plain, fp8, int8 / fp8
  per token-head). K and V of a key are the two halves of one row, loaded back to back."""

  def __init__(self, st: KernelStatics, h, q_ref, cache_ref, ks_ref, vs_ref, o_ref,
               words_ref=None):
    self.st, self.h, self.fmt = st, h, st.fmt
    self.q_ref, self.cache_ref, self.ks_ref, self.vs_ref, self.o_ref = (
        q_ref, cache_ref, ks_ref, vs_ref, o_ref)
    self.words_ref = words_ref if st.scale_words else None

  def load_q(self, q_rows, row_ok):
    """(q ``[rows, head_pad]``, score scale in the exp2 domain)."""
    st = self.st
    qk_scale = _softmax_scale(st, self.ks_ref) * _LOG2E
    if self.fmt.tensor_scaled:
      qk_scale = qk_scale * self.ks_ref[self.h]
    # q stays as loaded (a dot operand straight from memory); scaling q in registers first
    # is slower (register pressure; `triton-ragged-tiles` in benchmarks/RESULTS.md).
    return _load_rows(self.q_ref, q_rows, st, 0, row_ok), qk_scale

  def init_acc(self):
    return jnp.zeros((self.st.rows, self.st.head_pad), jnp.float32)

  def load_kv(self, blk, off, in_seq):
    st = self.st
    rows = self.fmt.addr.row(blk, off, self.h)
    k = _load_rows(self.cache_ref, rows, st, 0, in_seq)
    v = _load_rows(self.cache_ref, rows, st, self.fmt.v_offset, in_seq)
    return rows, k, v

  def scores(self, q, tiles, qk_scale, in_seq):
    st = self.st
    rows, k, _ = tiles
    s = _dot(st, q, k, (1, 1)) * qk_scale   # [rows, bk] float32: scale * q.k * log2(e)
    if self.fmt.row_scaled:
      s = s * _row_scale(self.cache_ref, rows, self.fmt.data_dim, in_seq,
                         self.words_ref)[None, :]
    return s

  def accumulate(self, q, acc, alpha, p, tiles, in_seq):
    st = self.st
    rows, _, v = tiles
    fmt = self.fmt
    if fmt.row_scaled:
      p = p * _row_scale(self.cache_ref, rows, fmt.v_offset + fmt.data_dim, in_seq,
                         self.words_ref)[None, :]
    return acc * alpha[:, None] + _dot(st, p.astype(fmt.compute_dtype), v, (1, 0))

  def store(self, acc, l, q_rows, row_ok):
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    if self.fmt.tensor_scaled:
      out = out * self.vs_ref[self.h]
    _store_rows(self.o_ref, q_rows, out.astype(self.o_ref.dtype), self.st, row_ok)


class _PageTiles:
  """K/V tiles through the format's tile hooks over the cache viewed as pages
  ``[B, page_elems]`` (int4 per token-head, nvfp4): even and odd head dims are kept apart
  (q read as two parts, values unpacked in registers, global k/v scales applied there), and
  the two output parts are stored interleaved back into ``[T*Hq, D]``."""

  def __init__(self, st: KernelStatics, h, q_ref, pages_ref, ks_ref, vs_ref, o_ref,
               words_ref=None):
    self.st, self.fmt, self.h = st, st.fmt, h
    self.words_ref = words_ref if st.scale_words else None
    self.q_ref, self.pages_ref, self.ks_ref, self.vs_ref, self.o_ref = (
        q_ref, pages_ref, ks_ref, vs_ref, o_ref)

  def _idx(self, q_rows, cols):
    shape = (self.st.rows, self.fmt.part_width)
    return (jnp.broadcast_to(q_rows[:, None], shape), jnp.broadcast_to(cols[None, :], shape))

  def load_q(self, q_rows, row_ok):
    """((q parts, per-row q sums for int4 zero points, k scale, v scale), score scale)."""
    fmt = self.fmt
    q_parts = []
    for part in range(fmt.num_parts):
      cols, cmask = fmt.part_cols(part)
      idx = self._idx(q_rows, jnp.minimum(cols, self.st.head_size - 1))
      qp = pltriton.load(self.q_ref.at[idx], mask=row_ok[:, None] & cmask[None, :], other=0.0)
      q_parts.append(fmt.q_operand(qp))
    qsum = sum(jnp.sum(qp.astype(jnp.float32), axis=1) for qp in q_parts)
    state = (q_parts, qsum, self.ks_ref[self.h], self.vs_ref[self.h])
    return state, _softmax_scale(self.st, self.ks_ref) * _LOG2E

  def init_acc(self):
    return tuple(jnp.zeros((self.st.rows, self.fmt.part_width), jnp.float32)
                 for _ in range(self.fmt.num_parts))

  def load_kv(self, blk, off, in_seq):
    valid = jnp.ones((self.st.block_kv,), jnp.bool_) if in_seq is None else in_seq
    views = () if self.words_ref is None else (self.words_ref,)
    return self.fmt.load_kv(self.pages_ref, blk, off, self.h, valid, views)

  def scores(self, state, tiles, qk_scale, in_seq):
    q_parts, qsum, k_scale, _ = state
    return self.fmt.scores(q_parts, qsum, tiles, k_scale) * qk_scale

  def accumulate(self, state, acc, alpha, p, tiles, in_seq):
    parts = self.fmt.values(p, tiles, state[3])
    return tuple(a * alpha[:, None] + o for a, o in zip(acc, parts))

  def store(self, acc, l, q_rows, row_ok):
    inv = 1.0 / jnp.where(l > 0, l, 1.0)
    for part, a in enumerate(acc):
      cols, cmask = self.fmt.part_cols(part)
      pltriton.store(self.o_ref.at[self._idx(q_rows, cols)],
                     (a * inv[:, None]).astype(self.o_ref.dtype),
                     mask=row_ok[:, None] & cmask[None, :])


def _kernel(tile_seq_ref, tile_q0_ref, qsl_ref, seq_lens_ref, bt_ref, q_ref, cache_ref,
            words_ref, ks_ref, vs_ref, sink_ref, _o_init_ref, o_ref, *, st: KernelStatics):
  """One (KV head, query tile) program: :class:`_RowTiles` for formats read as rows
  (``cache_ref`` holds rows), else :class:`_PageTiles` (``cache_ref`` holds pages);
  ``words_ref``: the same bytes as float32 words (``st.scale_words``; else a dummy)."""
  h = pl.program_id(0)
  tile = st.num_tiles - 1 - pl.program_id(1)      # last tiles (most keys) launch first
  tiles_cls = _RowTiles if st.fmt.row_table else _PageTiles
  tiles_of = tiles_cls(st, h, q_ref, cache_ref, ks_ref, vs_ref, o_ref, words_ref)
  g_count, bq, bk = st.group, st.bq, st.block_kv
  seq = tile_seq_ref[tile]
  q0 = tile_q0_ref[tile]
  q_start = qsl_ref[seq]
  q_len = qsl_ref[seq + 1] - q_start
  seq_len = seq_lens_ref[seq]
  nq = jnp.clip(q_len - q0, 0, bq)                 # query tokens in this tile
  pos_first = seq_len - q_len + q0
  pos_last = pos_first + nq - 1

  r = jnp.arange(st.rows, dtype=jnp.int32)
  tok = lax.div(r, g_count)
  g = lax.rem(r, g_count)
  row_ok = tok < nq
  hq = st.num_kv_heads * g_count
  # Rows outside the tile point one past the end of q: masked, and never aliasing a real row.
  q_rows = jnp.where(row_ok, (q_start + q0 + tok) * hq + h * g_count + g, q_ref.shape[0])
  q, qk_scale = tiles_of.load_q(q_rows, row_ok)
  row_pos = pos_first + tok
  if st.has_sinks:
    m0 = pltriton.load(sink_ref.at[h * g_count + g]).astype(jnp.float32) * _LOG2E
    l0 = jnp.ones((st.rows,), jnp.float32)
  else:
    m0 = jnp.full((st.rows,), _M_INIT, jnp.float32)
    l0 = jnp.zeros((st.rows,), jnp.float32)
  acc0 = tiles_of.init_acc()

  # Key range of this tile and the sub-range every row sees in full.
  empty = nq <= 0
  kv_hi = jnp.minimum(seq_len, pos_last + 1) if st.causal else seq_len
  kv_lo = jnp.maximum(pos_first - st.window + 1, 0) if st.window else jnp.int32(0)
  j_lo = lax.div(kv_lo, bk)
  j_hi = jnp.where(empty, j_lo, lax.div(kv_hi + bk - 1, bk))
  full_lo = (lax.div(jnp.maximum(pos_last - st.window + 1, 0) + bk - 1, bk)
             if st.window else j_lo)
  full_end = jnp.minimum(pos_first + 1, seq_len) if st.causal else seq_len
  full_hi = lax.div(full_end, bk)
  b = jnp.clip(full_lo, j_lo, j_hi)
  c = jnp.clip(full_hi, b, j_hi)

  def step(j, carry, masked):
    acc, m, l = carry
    kp = j * bk + jnp.arange(bk, dtype=jnp.int32)
    in_seq = kp < seq_len if masked else None
    page = jnp.minimum(lax.div(kp, st.block_size), st.max_blocks - 1)
    off = lax.rem(kp, st.block_size)
    bt_idx = seq * st.max_blocks + page
    if masked:
      blk = pltriton.load(bt_ref.at[bt_idx], mask=in_seq, other=0)
    else:
      blk = pltriton.load(bt_ref.at[bt_idx])
    blk = RB.clamp_blocks(blk, st.num_blocks)                  # kvjax.ragged_batch rule 4
    tiles = tiles_of.load_kv(blk, off, in_seq)
    s = tiles_of.scores(q, tiles, qk_scale, in_seq)
    if st.soft_cap is not None:     # c * tanh(x / c) on x = s / log2(e), back to log2 domain
      cap = st.soft_cap * _LOG2E
      s = cap * jnp.tanh(s * (1.0 / cap))
    if masked:
      vis = in_seq[None, :]
      if st.causal:
        vis = vis & (kp[None, :] <= row_pos[:, None])
      if st.window:
        vis = vis & (row_pos[:, None] - kp[None, :] < st.window)
      s = jnp.where(vis, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp2(s - m_new[:, None])
    if masked:
      p = jnp.where(vis, p, 0.0)
    alpha = jnp.exp2(m - m_new)
    l = l * alpha + jnp.sum(p, axis=1)
    acc = tiles_of.accumulate(q, acc, alpha, p, tiles, in_seq)
    return acc, m_new, l

  carry = (acc0, m0, l0)
  carry = lax.fori_loop(j_lo, b, functools.partial(_step_wrap, step, True), carry)
  carry = lax.fori_loop(b, c, functools.partial(_step_wrap, step, False), carry)
  carry = lax.fori_loop(c, j_hi, functools.partial(_step_wrap, step, True), carry)
  acc, _, l = carry
  tiles_of.store(acc, l, q_rows, row_ok)


def _step_wrap(step, masked, j, carry):
  return step(j, carry, masked)


def ragged_attention_call(q2d, cache2d, meta, k_scale_h, v_scale_h, sinks, out_init, *,
                          st: KernelStatics, cfg: TileConfig, interpret: bool, words=None):
  """Launch the kernel. ``meta`` = (tile_seq, tile_q0, query_start_loc, seq_lens, block_table_flat).

  q2d: ``[T*Hq, D]``; cache2d: the physical cache as rows ``[R, C]`` (``st.fmt.row_table``)
  or as pages ``[B, page_elems]``; k/v_scale_h: float32 ``[H]`` (fp8 / nvfp4 global scales;
  k with the softmax scale appended when it is traced); sinks: float32 ``[Hq]``; out_init: zeros ``[T*Hq, D]`` in q's dtype
  (aliased to the output, so rows no tile covers -- padding -- stay 0); words: cache2d's
  bytes as float32 words ``[R, C/4]`` when ``st.scale_words``. Returns ``[T*Hq, D]``.
  """
  kernel = functools.partial(_kernel, st=st)
  words = jnp.zeros((1, 1), jnp.float32) if words is None else words
  args = (*meta, q2d, cache2d, words, k_scale_h, v_scale_h, sinks, out_init)
  params = None if interpret else pltriton.CompilerParams(num_warps=cfg.num_warps,
                                                          num_stages=cfg.num_stages)
  return pl.pallas_call(
      kernel,
      grid=(st.num_kv_heads, st.num_tiles),
      out_shape=jax.ShapeDtypeStruct(out_init.shape, out_init.dtype),
      input_output_aliases={len(args) - 1: 0},
      compiler_params=params,
      interpret=interpret,
      name="kvjax_ragged_paged_attention" + ("" if st.fmt.row_table else "_split"),
  )(*args)
