"""Tiling of the Mosaic GPU ragged attention: tile geometry (static) and per-tile metadata.

A program handles one KV head and one *query tile*: ``bq`` consecutive query tokens of one
sequence times the G query heads of that KV head. In shared memory the tile's rows are
ordered head-major, ``row = g * bq + token``, so head g's rows are one ``(bq, D)`` box of q
(``q[t0:t0+bq, h*G+g, :]``, rows strided by ``Hq*D``): one TMA copy per head, no transpose
of q in XLA. Rows are split over ``num_wgs`` consumer warpgroups of 64 rows each (the
wgmma M); a head's slab never straddles a warpgroup unless it is the only head (G = 1,
bq = 128, one 64-token half per warpgroup). ``bq`` is a power of two >= 8 so that every
slab starts on a multiple of 8 rows (the SMEM tiling of wgmma operands).

Alignment: a TMA copy into a tiled shared-memory buffer (the
``(8, 64)``-element tiles with 128-byte swizzle that wgmma reads) addresses global memory
as 8-row tiles, so its first row must be a multiple of 8 there, or rows of every 8-row
group are lost (zero-filled on loads). K/V pieces satisfy it (``piece`` is a multiple of 8
and divides the block size, so a piece starts at a multiple of 8 within its page); q tiles
start at any token, so the kernel copies q into plain (untiled) shared memory first.

Padding tokens (at or past ``query_start_loc[S]``) are covered by tiles of a pseudo-sequence
with no keys, so the kernel writes every output row exactly once (zeros there) and no
zero-initialized output buffer or post-pass is needed.

Everything here is static Python or pure jnp on int32 metadata (no host sync).
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels import ragged_schedule as sched
from pallas_kernels.mosaic_gpu.tuning import DEFAULT_PV as DEFAULT_PV_VARIANT

WG_ROWS = 64           # rows of one consumer warpgroup (wgmma M)
MIN_BQ = 8             # slab alignment: the (8, swizzle) SMEM tiling of wgmma operands
MAX_GROUP = 2 * WG_ROWS // MIN_BQ    # 16 query heads per KV head at most

#: How the kernel issues ``acc += P V`` (the only place its variants differ):
#: "p_regs": P is the register A operand of wgmma and acc's registers its accumulator,
#:   updated in place (as JAX's FlashAttention-3 kernel does);
#: "p_smem": P is stored to a per-warpgroup shared-memory buffer, acc updated in place;
#: "p_smem_fresh": P through shared memory, the product into a fresh zero accumulator that
#:   is then added to acc in registers (the only form Mosaic GPU interpret mode runs).
#: Compiled, the kernel defaults to :data:`.tuning.DEFAULT_PV`; interpret mode to
#: "p_smem_fresh" (:func:`default_pv`).
PV_REGS, PV_SMEM, PV_SMEM_FRESH = "p_regs", "p_smem", "p_smem_fresh"
PV_VARIANTS = (PV_REGS, PV_SMEM, PV_SMEM_FRESH)
DEFAULT_PV = DEFAULT_PV_VARIANT


#: How q and the output tile pass through shared memory (``kernel.py``; both are copied by
#: TMA into / out of memory that is not tiled, since a tile starts at any token):
#: "plain": one buffer per consumer warpgroup of rows ``2 * D`` bytes apart, q staged in the
#:   output buffer; loads and stores between it and registers are 8-way bank-conflicted.
#: "swizzled": one buffer of 64-column chunks of 128-byte rows with the 128-byte swizzle
#:   (conflict-free), q staged in the output buffer.
#: "q_own": as "swizzled", q in a buffer of its own (its copies need not wait for the
#:   previous item's output stores; one more q-sized buffer).
STAGING_PLAIN, STAGING_SWIZZLED, STAGING_Q_OWN = "plain", "swizzled", "q_own"
STAGINGS = (STAGING_PLAIN, STAGING_SWIZZLED, STAGING_Q_OWN)


def default_pv(interpret: bool) -> str:
  """The P V variant a call without ``pv`` runs: :data:`DEFAULT_PV` compiled, the one form
  Mosaic GPU interpret mode takes otherwise."""
  return PV_SMEM_FRESH if interpret else DEFAULT_PV


#: Rows of the metadata array handed to the kernel, one column per tile.
META_TOK0, META_NQ, META_POS0, META_KV_LEN, META_BT_ROW = range(5)
META_ROWS = 5


def copy_piece(block_size: int, block_kv: int) -> int:
  """Tokens per K/V copy of a step of ``block_kv`` keys over pages of ``block_size``: a page,
  or the part of a page one step holds (a piece never straddles a page)."""
  return math.gcd(block_size, block_kv)


@dataclasses.dataclass(frozen=True)
class Slab:
  """One TMA box of q / out: head ``g`` of the group, tokens ``[tok, tok + n)`` of the tile,
  stored at rows ``[row, row + n)`` of its warpgroup's 64-row buffer."""
  g: int
  tok: int
  n: int
  row: int


@dataclasses.dataclass(frozen=True)
class TileGeometry:
  """Static tile shape of one call.

  group: G, query heads per KV head. bq: query tokens per tile (power of two >= 8).
  num_wgs: consumer warpgroups (1 or 2). block_kv: keys per pipeline step (64 or 128).
  stages: K/V shared-memory slots in flight. block_size: N, tokens per page.
  """
  group: int
  bq: int
  num_wgs: int
  block_kv: int
  stages: int
  block_size: int

  def __post_init__(self):
    if self.bq < MIN_BQ or self.bq & (self.bq - 1):
      raise ValueError(f"bq={self.bq} must be a power of two >= {MIN_BQ}")
    if self.num_wgs not in (1, 2):
      raise ValueError(f"num_wgs={self.num_wgs} must be 1 or 2")
    if self.group * self.bq > self.rows:
      raise ValueError(f"group {self.group} x bq {self.bq} exceeds {self.rows} tile rows")
    if self.block_kv % 64:
      raise ValueError(f"block_kv={self.block_kv} must be a multiple of 64")
    if self.stages < 2:
      raise ValueError(f"stages={self.stages} must be >= 2")
    if self.block_size % MIN_BQ:
      raise ValueError(f"block_size={self.block_size} must be a multiple of {MIN_BQ}: K/V "
                       f"pieces land in {MIN_BQ}-row tiles of shared memory")

  @property
  def rows(self) -> int:
    return WG_ROWS * self.num_wgs

  @property
  def piece(self) -> int:
    """Tokens per K/V copy: a page, or the part of a page that one step holds (pieces never
    straddle a page since the piece divides the block size)."""
    return copy_piece(self.block_size, self.block_kv)

  @property
  def pieces_per_step(self) -> int:
    return self.block_kv // self.piece

  def slabs(self, wg: int) -> tuple[Slab, ...]:
    """The q / out boxes of consumer warpgroup ``wg`` (static)."""
    lo, hi = wg * WG_ROWS, (wg + 1) * WG_ROWS
    if self.bq >= WG_ROWS:                       # G = 1 (or 2 with bq = 64): whole halves
      g, tok = divmod(lo, self.bq)
      return (Slab(g, tok, WG_ROWS, 0),) if g < self.group else ()
    out = []
    for g in range(lo // self.bq, hi // self.bq):
      if g < self.group:
        out.append(Slab(g, 0, self.bq, g * self.bq - lo))
    return tuple(out)

  def smem_bytes(self, head_size: int, itemsize: int, pv: str = DEFAULT_PV,
                 staging: str = STAGING_SWIZZLED, rotation: bool = False,
                 landing: int = 0) -> int:
    """Shared memory of the kernel's buffers: q, out staging, K and V slots, the P buffers of
    the variants that pass P through shared memory, q's own staging buffer with
    ``staging`` :data:`STAGING_Q_OWN`, with ``rotation`` the ``(D, D)`` matrix of the
    format's rotation (:meth:`kvjax.rotation.Rotation.products`), and with ``landing`` (the
    bytes of one side's stored key row) the K and V slots a quantized step lands in before
    the producer converts it (:mod:`.ragged_landing`)."""
    q_and_out = (3 if staging == STAGING_Q_OWN else 2) * self.rows * head_size * itemsize
    kv = 2 * self.stages * self.block_kv * head_size * itemsize
    p = 0 if pv == PV_REGS else self.rows * self.block_kv * itemsize
    matrix = head_size * head_size * itemsize if rotation else 0
    return q_and_out + kv + p + matrix + 2 * self.block_kv * landing


#: Hopper: 227 KiB of shared memory per block, less 3 KiB for what Mosaic GPU adds to the
#: kernel's buffers (barriers, reduction scratch, alignment: 2136 bytes on the default tile,
#: read from its lowering).
SMEM_BUDGET = 227 * 1024 - 3 * 1024


def max_group(head_size: int) -> int:
  """Most query heads per KV head: 8-token slabs in 128 rows (64 rows at head size 256,
  where two warpgroups' q, out staging and K/V slots would not fit in shared memory)."""
  return MAX_GROUP if head_size <= 128 else MAX_GROUP // 2


def choose_geometry(group: int, head_size: int, block_size: int, max_query_len: int,
                    itemsize: int = 2, pv: str = DEFAULT_PV,
                    rotation: bool = False, landing: int = 0) -> TileGeometry:
  """The tile for a call: the largest power-of-two ``bq`` with ``G * bq <= 128`` rows, cut
  to the max_query_len bucket (>= 8); one consumer warpgroup when 64 rows hold the tile
  (decode-sized buckets, head size 256); 128 keys a step (64 for head size 256), as many
  K/V slots (<= 4) as fit in shared memory next to the ``pv`` variant's buffers (and the
  rotation's matrix with ``rotation`` and a quantized step's landing slots with ``landing``;
  the result may not fit: :meth:`TileGeometry.smem_bytes` says). K/V copies are
  ``gcd(block_size, block_kv)`` tokens each."""
  if not 1 <= group <= max_group(head_size):
    raise ValueError(f"GQA group size {group} is outside [1, {max_group(head_size)}] at head "
                     f"size {head_size}")
  max_rows = WG_ROWS if head_size > 128 else 2 * WG_ROWS
  bq = sched.next_pow2(max_rows // group + 1) // 2          # largest pow2 <= rows // G
  bq = max(MIN_BQ, min(bq, sched.next_pow2(max(1, max_query_len))))
  num_wgs = 1 if group * bq <= WG_ROWS else 2
  block_kv = 64 if head_size > 128 else 128
  stages = 4
  while stages > 2:
    geo = TileGeometry(group, bq, num_wgs, block_kv, stages, block_size)
    if geo.smem_bytes(head_size, itemsize, pv, rotation=rotation,
                      landing=landing) <= SMEM_BUDGET:
      return geo
    stages -= 1
  return TileGeometry(group, bq, num_wgs, block_kv, stages, block_size)


def choose_staging(geo: TileGeometry, head_size: int, itemsize: int = 2,
                   pv: str = DEFAULT_PV, interpret: bool = False,
                   rotation: bool = False, landing: int = 0) -> str:
  """How q and the output pass through shared memory (:data:`STAGINGS`): q in a buffer of
  its own wherever that buffer fits next to the tile's K/V slots (it costs none of them),
  else both in one swizzled buffer; interpret mode stages plainly (the form its simulator is
  known to run). q in its own swizzled buffer is faster than the plain one
  (benchmarks/RESULTS.md, `mgpu-persistent`)."""
  if interpret:
    return STAGING_PLAIN
  if geo.smem_bytes(head_size, itemsize, pv, STAGING_Q_OWN, rotation, landing) <= SMEM_BUDGET:
    return STAGING_Q_OWN
  return STAGING_SWIZZLED


def num_tiles_bound(num_tokens: int, num_seqs: int, bq: int) -> int:
  """Static grid size along query tiles: the S sequences plus the padding pseudo-sequence
  each waste less than one tile, so ``cdiv(T, bq) + S + 1`` tiles cover every token."""
  return sched.cdiv(num_tokens, bq) + num_seqs + 1


def tile_metadata(query_start_loc, seq_lens, block_table_width: int, num_tokens: int,
                  num_tiles: int, bq: int):
  """Per-tile scalars, int32 ``[META_ROWS, num_tiles]``.

  Rows: first flattened query token (clamped to T), real query tokens in the tile (0 for
  surplus tiles), absolute position of the first token, key count of the sequence (0 for
  padding tiles: they write zeros), flat offset of the sequence's block-table row.
  """
  qsl = query_start_loc.astype(jnp.int32)
  num_seqs = seq_lens.shape[0]
  qsl_ext = jnp.concatenate([qsl, jnp.full((1,), num_tokens, jnp.int32)])
  seq, q0 = sched.tile_schedule(qsl_ext, num_tiles, bq)     # seq == S: padding tokens
  q_len = qsl_ext[seq + 1] - qsl_ext[seq]
  nq = jnp.clip(q_len - q0, 0, bq)
  is_pad = seq >= num_seqs
  real_seq = jnp.minimum(seq, num_seqs - 1)
  kv_len = jnp.where(is_pad, 0, seq_lens.astype(jnp.int32)[real_seq])
  tok0 = jnp.where(nq > 0, qsl_ext[seq] + q0, num_tokens)
  pos0 = jnp.where(nq > 0, kv_len - q_len + q0, 0)
  bt_row = real_seq * block_table_width
  return jnp.stack([tok0, nq, pos0, kv_len, bt_row]).astype(jnp.int32)
