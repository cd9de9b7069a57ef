"""Triton cache write by slot mapping, quantize-on-write for every cache format.

Entry point :func:`write_kv` (the "pallas" implementation of ``kvjax.registry.WRITE``,
called by ``kvjax.write_kv`` after validation). It stores the same bytes as
``kvjax.reference.cache_update.write_kv`` under ``jax.jit``: the quantizers are the shared
:mod:`kvjax.quant` formulas, divisions IEEE (:mod:`pallas_kernels.triton.ieee`). (On a GPU,
XLA-GPU's own compile of the int8 / int4 per-token-head reference differs from XLA-CPU's in a
few bytes, so those two are exact against the CPU reference only: benchmarks/RESULTS.md, "Writes".)

How it works. The physical cache is handed to the kernel whole
(``BlockSpec(memory_space=pl.ANY)``) as a 2-D table (a free reshape of the contiguous
array), aliased to the output (``input_output_aliases``), so under a ``jit`` that donates
the cache the write is in place. The format's hooks (:mod:`pallas_kernels.triton.formats`)
say what a table row is (a (token, head) row of ``C`` elements, or an nvfp4 page side) and
encode and store each program's tokens.

One program handles ``tokens_per_program`` tokens x H heads (kernel rows): it loads the
tokens' slots, their K and V rows, quantizes them in registers and stores each segment with
computed (row, column) indices and a mask. Formats whose row segments all sit at multiples of
4 bytes (per-token-head int8 / fp8, int4: ``TileFormat.write_words``) see the table as uint32
words (a free bitcast view of the cache): each thread packs 4 one-byte codes or 8 nibbles into
a word and stores the scale as one word, instead of storing bytes. Only rows named by a slot
in ``[0, B*N)`` are stored, and addresses are formed from in-range slots only (int32 never
wraps); no other cache byte is read or written (on GPU masked lanes are not accessed; in
interpret mode they point out of bounds and are dropped). In interpret mode the cache is stored
through an
unsigned-integer view: XLA on CPU converts bf16 / fp8 arrays it scatters into through float32,
which would rewrite the NaN payloads of bytes the write does not name. (Compiled Triton stores
move the stored bytes only.) Blocks have power-of-2 sizes: heads, head sizes and scale
groups are padded and masked.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from kvjax import quant
from kvjax.slots import int32_slots
from kvjax.spec import KVCacheSpec
from pallas_kernels.common import cdiv, next_pow2
from pallas_kernels.triton import tuning
from pallas_kernels.triton.adapters import hooks_reason, tile_format
from pallas_kernels.triton.formats import TileFormat

_I32 = jnp.int32
_MAX_ROWS = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class WriteConfig:
  """Launch parameters of the write kernel (GPU; interpret mode ignores warps/stages).

  :func:`default_config` picks them per format (:func:`pallas_kernels.triton.tuning.write_defaults`).
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
  """The format's measured launch config (:func:`pallas_kernels.triton.tuning.write_defaults`)."""
  tokens, pair_split = tuning.write_defaults(tile_format(spec))
  return WriteConfig(tokens_per_program=tokens, num_warps=4, pair_split=pair_split)


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static geometry of one write (hashable: closes over the kernel)."""
  fmt: TileFormat       # the format's hooks
  heads_p: int          # H padded to a power of 2
  num_rows: int         # rows of the table
  num_slots: int        # B * N: slots outside [0, num_slots) are dropped
  num_tokens: int       # T
  tb: int               # tokens per program
  compiled: bool        # Triton lowering (False: interpret mode)
  pair_split: bool

  @property
  def heads(self) -> int:
    return self.fmt.num_heads

  @property
  def rows(self) -> int:
    return self.tb * self.heads_p


def _plan(fmt: TileFormat, num_blocks: int, num_tokens: int, config: WriteConfig,
          compiled: bool) -> _Plan:
  num_rows, _ = fmt.write_table(num_blocks)
  if num_rows > _MAX_ROWS:
    raise ValueError(f"cache has {num_rows} rows, more than the kernel's int32 row index allows")
  return _Plan(fmt, next_pow2(fmt.num_heads), num_rows, num_blocks * fmt.block_size,
               num_tokens, config.tokens_per_program, compiled, config.pair_split)


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


@dataclasses.dataclass(frozen=True)
class _IO:
  """One program's view of its inputs and output, as the format hooks use it."""
  p: _Plan
  sources: tuple        # (K ref, V ref): ``[T*H, D]`` model-dtype rows
  src_row: jax.Array    # per kernel row: its source row
  scale_ref: object     # float32 [2H] global scales (K then V)
  out_ref: object       # the table

  @staticmethod
  def cols(n: int, n_valid: int):
    """(store columns, clamped load columns, column mask or None) of a padded segment."""
    c = jnp.arange(n, dtype=_I32)
    if n == n_valid:
      return c, c, None
    return c, jnp.minimum(c, n_valid - 1), c < n_valid

  def rows(self, side: int, cols, dtype=jnp.float32):
    """Gather ``src[src_row, cols]`` -> ``[rows, *cols.shape]`` converted to ``dtype``
    (``cols``: column indices of any shape)."""
    shape = self.src_row.shape + cols.shape
    row = self.src_row.reshape(self.src_row.shape + (1,) * cols.ndim)
    x = pltriton.load(self.sources[side].at[jnp.broadcast_to(row, shape),
                                            jnp.broadcast_to(cols[None], shape)])
    return x.astype(dtype)

  def groups(self, side: int, num_groups: int, size: int, num_cols: int):
    """Source elements ``[rows, num_groups, size]`` (float32), element ``g * size + i`` of
    each row at ``[:, g, i]``; columns past ``num_cols`` repeat the last one (harmless for
    min / max / amax; their results are masked)."""
    # iota along the last dim plus a multiple of size (not a reshaped iota): Triton then
    # sees ``size`` contiguous elements and loads them as vectors
    c = (jnp.arange(num_groups, dtype=_I32)[:, None] * size
         + jnp.arange(size, dtype=_I32)[None, :])
    if num_groups * size != num_cols:
      c = jnp.minimum(c, num_cols - 1)
    return self.rows(side, c)

  def pairs(self, side: int, num_pairs: int, num_cols: int):
    """Even and odd elements ``[rows, num_pairs]`` (float32) of source rows with ``num_cols``
    valid columns; pairs past the end repeat the last pair (harmless for min / max / amax)."""
    if self.p.pair_split:
      c = jnp.arange(2 * num_pairs, dtype=_I32)
      if 2 * num_pairs != num_cols:
        c = jnp.minimum(c, num_cols - 1)
      x = self.rows(side, c).reshape(self.src_row.shape[0], num_pairs, 2)
      even, odd = jnp.split(x, 2, axis=2)
      return even.reshape(even.shape[:2]), odd.reshape(odd.shape[:2])
    j = jnp.arange(num_pairs, dtype=_I32)
    if 2 * num_pairs != num_cols:
      j = jnp.minimum(j, num_cols // 2 - 1)
    return self.rows(side, 2 * j), self.rows(side, 2 * j + 1)

  def tensor_scale(self, side: int, head):
    """The global scale of each kernel row's head, float32 ``[rows]``."""
    return pltriton.load(self.scale_ref.at[head + side * self.p.heads])

  def store(self, rows, cols, val, mask):
    """Store ``val`` at ``table[rows, cols]`` (index arrays of val's shape) where ``mask``."""
    if not self.p.compiled:
      val = quant.to_bits(val)
    pltriton.store(self.out_ref.at[rows, cols], val, mask=mask)

  def store_rows(self, row, col, val, valid, col_mask):
    """Store ``val [rows, n]`` at ``table[row[:, None], col[None, :]]`` where valid (and
    col_mask)."""
    shape = val.shape
    mask = jnp.broadcast_to(valid[:, None], shape)
    if col_mask is not None:
      mask = mask & jnp.broadcast_to(col_mask[None, :], shape)
    self.store(jnp.broadcast_to(row[:, None], shape), jnp.broadcast_to(col[None, :], shape),
               val, mask)


def _kernel(p: _Plan, slots_ref, k_ref, v_ref, scale_ref, cache_in_ref, out_ref):
  del cache_in_ref  # aliased to out_ref
  slot, head, valid, src_row = _token_rows(p, slots_ref)
  p.fmt.write_tokens(p, _IO(p, (k_ref, v_ref), src_row, scale_ref, out_ref), slot, head, valid)


# -- entry point --------------------------------------------------------------------------------
def supports_write(spec: KVCacheSpec):
  """Registry hook: every format whose codec has Triton hooks."""
  return hooks_reason(spec)


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
  fmt = tile_format(spec)
  p = _plan(fmt, cache.shape[0], t, config, compiled=not interpret)
  h, d = spec.num_kv_heads, spec.head_size
  k2 = key.reshape(key.shape[0] * h, d)
  v2 = value.reshape(value.shape[0] * h, d)
  slots = int32_slots(slot_mapping, p.num_slots)
  scales = fmt.write_scales(k_scale, v_scale)
  rows, cols = fmt.write_table(cache.shape[0])
  if fmt.write_words:   # one-byte storage as uint32 words (a free bitcast)
    table = jax.lax.bitcast_convert_type(quant.to_bits(cache).reshape(rows, cols, 4), jnp.uint32)
  else:
    table = cache.reshape(rows, cols)
  if interpret:     # interpret mode stores through XLA scatters: move bits, never floats
    table = quant.to_bits(table)
  any_spec = pl.BlockSpec(memory_space=pl.ANY)
  extra = {}
  if not interpret:
    extra["compiler_params"] = pltriton.CompilerParams(num_warps=config.num_warps,
                                                       num_stages=config.num_stages)
  out = pl.pallas_call(
      functools.partial(_kernel, p),
      out_shape=jax.ShapeDtypeStruct(table.shape, table.dtype),
      grid=(cdiv(t, p.tb),),
      in_specs=[any_spec] * 5,
      out_specs=any_spec,
      input_output_aliases={4: 0},
      interpret=interpret,
      name=f"write_kv_{spec.cache_dtype}_{spec.layout}",
      **extra,
  )(slots, k2, v2, scales, table)
  if fmt.write_words:
    out = jax.lax.bitcast_convert_type(out, quant.bits_dtype(cache.dtype))
  return quant.from_bits(out.reshape(cache.shape), cache.dtype)
