"""Static shape of the Mosaic GPU decode kernel (:mod:`.decode_kernel`): its geometry, the GQA
groups it packs, the K/V slots that fit, the split count, and everything static one call's
kernel body needs (:class:`DecodeStatics`). Pure Python (no Mosaic GPU import): the
registry's checks run it on any machine.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from pallas_kernels.common import cdiv
from pallas_kernels.mosaic_gpu.formats import Operands
from pallas_kernels.mosaic_gpu.tiles import SMEM_BUDGET, copy_piece

ALIGN_ROWS = 8             # rows of a tile of the shared-memory layout wgmma reads
#: Shared memory Mosaic GPU adds to a kernel's buffers (barriers, the cross-warp reduction
#: scratch, alignment): 3.05 KiB measured by ncu for this kernel on the H200, rounded up.
MOSAIC_RESERVED = 4096


@dataclasses.dataclass(frozen=True)
class DecodeGeometry:
  """Static shape of one decode call.

  group: G, query heads per KV head. block_size: N, tokens per page. head_size: D.
  block_kv: keys per step (wgmma M of ``S^T``, the keys of one K/V slot). cols: query
  columns (wgmma N). stages: K/V slots. round_steps: steps of one softmax update (1 or 2):
  the round's scores share one running-max reduction and its values one ``V^T P^T`` product.
  """
  group: int
  block_size: int
  head_size: int
  block_kv: int = 64
  cols: int = 16
  stages: int = 3
  round_steps: int = 1

  def __post_init__(self):
    why = head_size_reason(self.head_size)
    if why is not None:
      raise ValueError(why)
    if self.block_kv != 64:
      raise ValueError(f"block_kv={self.block_kv} must be 64 (the wgmma M of S^T)")
    if self.round_steps not in (1, 2):
      raise ValueError(f"round_steps={self.round_steps} must be 1 or 2")
    if self.stages < max(2, self.round_steps):
      raise ValueError(f"stages={self.stages} must be >= 2 and >= round_steps")
    if self.piece % ALIGN_ROWS:
      raise ValueError(f"block_size={self.block_size}: K/V copies of gcd(block_size, 64) = "
                       f"{self.piece} tokens must be a multiple of {ALIGN_ROWS}")

  @property
  def piece(self) -> int:
    """Tokens per TMA copy (:func:`.tiles.copy_piece`)."""
    return copy_piece(self.block_size, self.block_kv)

  def col_offset(self, head: int) -> int:
    """Column of head ``head``'s first query in S^T (its rows start on 8-row tiles)."""
    return (head * self.group) % ALIGN_ROWS

  def smem_bytes(self, ops: Operands, finish: bool = False) -> int:
    """Shared memory of a block: q, then the larger of the key loop's buffers and the
    epilogue's (scoped one after the other), and Mosaic GPU's own (:data:`MOSAIC_RESERVED`).
    ``finish``: the epilogue writes output rows (a 16-bit ``(T, D)`` buffer, ``O^T`` and the
    ``(T, 16)`` selection in the compute dtype) instead of float32 partials."""
    t, d = self.block_kv, self.head_size
    compute = np.dtype(ops.compute).itemsize
    land = 2 * self.stages * t * ops.landing_cols(d) * np.dtype(ops.storage).itemsize
    loop = land + 2 * ops.scratch_bytes(t, d) + self.round_steps * t * (d + self.cols) * compute
    if finish:
      epilogue = (d + t) * self.cols * compute + t * d * 2
    else:
      epilogue = (d + 2) * self.cols * 4
    return self.cols * d * compute + max(loop, epilogue) + MOSAIC_RESERVED


def head_size_reason(head_size: int) -> Optional[str]:
  """None when the kernel takes head size D (the wgmma M of ``V^T P^T``: a multiple of 64 up
  to 256), else why not."""
  if head_size % 64 or not 64 <= head_size <= 256:
    return f"head_size={head_size}: the decode kernel takes 64, 128, 192 or 256"
  return None


def group_reason(group: int, num_kv_heads: int, cols: int = 16) -> Optional[str]:
  """None when every head's queries fit the ``cols`` columns of S^T, else why not."""
  worst = max((h * group) % ALIGN_ROWS for h in range(num_kv_heads)) + group
  if worst > cols:
    return (f"GQA group {group}: a head's queries start up to {worst - group} rows into an "
            f"8-row tile and need {worst} > {cols} query columns")
  return None


def choose_geometry(ops: Operands, group: int, block_size: int, head_size: int,
                    max_stages: int = 8, finish: bool = False, round_steps: int = 1, *,
                    blocks_per_sm: int) -> DecodeGeometry:
  """The most K/V slots (2 to ``max_stages``) with which ``blocks_per_sm`` blocks
  (:func:`.tuning.decode_blocks_per_sm`) fit in an SM's shared memory (``finish``:
  :meth:`DecodeGeometry.smem_bytes`); where two slots do not fit that many blocks, the most
  slots for the most blocks two slots fit."""
  two = DecodeGeometry(group, block_size, head_size, stages=2, round_steps=round_steps)
  for blocks in range(blocks_per_sm, 0, -1):
    if two.smem_bytes(ops, finish) * blocks > SMEM_BUDGET:
      continue
    best = two
    for stages in range(3, max_stages + 1):
      geo = dataclasses.replace(best, stages=stages)
      if geo.smem_bytes(ops, finish) * blocks > SMEM_BUDGET:
        break
      best = geo
    return best
  return two


def num_splits_for(num_seqs: int, num_kv_heads: int, max_steps: int, num_sms: int,
                   blocks_per_sm: int) -> int:
  """Splits per (sequence, KV head), from static shapes: ``blocks_per_sm`` blocks per SM
  at a time (:func:`.tuning.decode_blocks_per_sm`), so pick the fewest splits whose waves of
  blocks come within 5 % of the best fill of the GPU (a split is one more partial to merge),
  with at most 64 splits and at least 4 key steps (of ``max_steps``) a split."""
  base = max(1, num_seqs * num_kv_heads)
  slots = blocks_per_sm * num_sms
  cands = range(1, max(1, min(64, max_steps // 4)) + 1)
  cost = {k: cdiv(base * k, slots) / k for k in cands}
  best = min(cost.values())
  return min(k for k in cands if cost[k] <= 1.05 * best)


@dataclasses.dataclass(frozen=True)
class DecodeStatics:
  """Everything static the kernel body needs."""
  geo: DecodeGeometry
  ops: Operands
  num_kv_heads: int           # H
  layout: str                 # "NHD" / "HND"
  num_blocks: int             # B
  num_seqs: int               # S, sequences of the batch (query rows may be more or fewer)
  max_blocks: int             # block_table.shape[1]
  num_splits: int
  window: Optional[int]
  soft_cap: Optional[float]
  interpret: bool = False     # Mosaic GPU interpret mode (CPU, jax >= 0.11)
  finish: bool = False        # the block writes normalized output rows (one split only)
  sinks: bool = False         # finish: the running max and sum start at the sinks
  layer_axis: Optional[int] = None   # a layered (5-D) cache: its layer dim; the layer is read
                                     # from an int32 [1] operand (one program for every layer)
  # Row-scaled formats (ops.row_scaled) read the cache through a view of rows of r =
  # tokens_per_row tokens (decode.cache_view): (B, N / r, r * H * C) for NHD, (B, H, N / r,
  # r * C) for HND, r = 2 where one token's rows are not 16 bytes apart (TMA's stride rule;
  # then geo.round_steps is 2); side_dim: P, bytes of a side row; content_dim: C = 2 P.
  tokens_per_row: int = 1
  side_dim: int = 0
  content_dim: int = 0

  def __post_init__(self):
    if self.finish and self.num_splits != 1:
      raise ValueError(f"finish=True writes whole outputs: num_splits={self.num_splits} "
                       "must be 1")
    if self.sinks and not self.finish:
      raise ValueError("sinks in the kernel need finish=True (partials merge them in XLA)")
    if self.ops.row_scaled and self.layer_axis is not None:
      raise ValueError("a layered cache of a row-scaled format: the decode kernel reads one "
                       "layer's cache")
    if self.ops.scale_copies and self.geo.round_steps != 1:
      raise ValueError("group scales are staged once a step: round_steps must be 1, got "
                       f"{self.geo.round_steps}")
    if self.geo.round_steps % self.tokens_per_row:
      raise ValueError(f"rows of {self.tokens_per_row} tokens: a round's steps take one token "
                       f"parity each, round_steps={self.geo.round_steps} must be a multiple")

  @property
  def capacity(self) -> int:
    """Keys a block-table row can name: ``max_blocks * block_size``."""
    return self.max_blocks * self.geo.block_size

  @property
  def span(self) -> int:
    """Tokens of the cache one round walks: ``u = geo.round_steps`` steps of T keys."""
    return self.geo.block_kv * self.geo.round_steps

  @property
  def step_span(self) -> int:
    """Tokens of the cache one step's copies read: T (``r = tokens_per_row`` = 1), or the
    whole round of ``2 T`` (r = 2: step j of a round holds its tokens of parity j)."""
    return self.geo.block_kv * self.tokens_per_row

  def key_offset(self, step: int) -> int:
    """Step ``step``'s first key past the round's first; its row t holds key
    ``key_offset(step) + r * t``."""
    return step if self.tokens_per_row == 2 else step * self.geo.block_kv

  def step_parity(self, step: int) -> int:
    """The token parity a round's step ``step`` reads of each view row (0 when r = 1)."""
    return step % self.tokens_per_row

  @property
  def piece(self) -> int:
    """Tokens one copy reads from: a page, or the part of it a step's span holds."""
    return copy_piece(self.geo.block_size, self.step_span)

  @property
  def copies_per_step(self) -> int:
    """TMA copies of one side per step: one per piece of its span."""
    return self.step_span // self.piece

  def landing_offsets(self, head_parity: int, parity: int):
    """Static ``(K, V)`` offsets of a row-scaled format's data in its landing rows: a copy
    starts at the 16-byte boundary at or before its side row (TMA's rule for a box's first
    byte), so the data land that far in: the row's byte offset mod 16 in the cache view, for
    step parity ``parity`` and, in NHD (heads are columns), head parity ``head_parity``."""
    c = self.content_dim
    row = c * (self.num_kv_heads if self.layout == "NHD" else 1)
    head = head_parity * c if self.layout == "NHD" else 0
    return tuple((parity * row + head + side * self.side_dim) % 16 for side in (0, 1))

  @property
  def head_parities(self) -> tuple:
    """The head parities whose landing offsets differ (NHD rows of C = 8 mod 16 bytes)."""
    if self.ops.row_scaled and self.layout == "NHD" and self.content_dim % 16:
      return (0, 1)
    return (0,)
