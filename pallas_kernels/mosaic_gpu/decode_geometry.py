"""Static shape of the Mosaic GPU decode kernel (:mod:`.decode_kernel`): its geometry, the GQA
groups it packs, the K/V slots that fit and the split count. Pure Python (no Mosaic GPU
import): the registry's checks run it on any machine.
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
#: Blocks the kernel is sized to keep on one SM at a time (shared memory allows two).
BLOCKS_PER_SM = 2


@dataclasses.dataclass(frozen=True)
class DecodeGeometry:
  """Static shape of one decode call.

  group: G, query heads per KV head. block_size: N, tokens per page. head_size: D.
  block_kv: keys per step (wgmma M of ``S^T``). cols: query columns (wgmma N).
  stages: K/V slots.
  """
  group: int
  block_size: int
  head_size: int
  block_kv: int = 64
  cols: int = 16
  stages: int = 3

  def __post_init__(self):
    why = head_size_reason(self.head_size)
    if why is not None:
      raise ValueError(why)
    if self.block_kv != 64:
      raise ValueError(f"block_kv={self.block_kv} must be 64 (the wgmma M of S^T)")
    if self.stages < 2:
      raise ValueError(f"stages={self.stages} must be >= 2")
    if self.piece % ALIGN_ROWS:
      raise ValueError(f"block_size={self.block_size}: K/V copies of gcd(block_size, 64) = "
                       f"{self.piece} tokens must be a multiple of {ALIGN_ROWS}")

  @property
  def piece(self) -> int:
    """Tokens per TMA copy (:func:`.tiles.copy_piece`)."""
    return copy_piece(self.block_size, self.block_kv)

  @property
  def pieces_per_step(self) -> int:
    return self.block_kv // self.piece

  def col_offset(self, head: int) -> int:
    """Column of head ``head``'s first query in S^T (its rows start on 8-row tiles)."""
    return (head * self.group) % ALIGN_ROWS

  def smem_bytes(self, ops: Operands, finish: bool = False) -> int:
    """Shared memory of a block: its buffers and Mosaic GPU's own (:data:`MOSAIC_RESERVED`).
    ``finish``: the kernel writes output rows (a 16-bit ``(T, D)`` buffer and ``O^T`` in the
    compute dtype) instead of float32 partials."""
    t, d = self.block_kv, self.head_size
    compute = np.dtype(ops.compute).itemsize
    land = 2 * self.stages * t * d * np.dtype(ops.storage).itemsize
    v = t * d * compute
    q = self.cols * d * compute
    p = t * self.cols * compute
    out = d * self.cols * compute + t * d * 2 if finish else (d + 2) * self.cols * 4
    return land + v + q + p + out + MOSAIC_RESERVED


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
                    max_stages: int = 8, finish: bool = False) -> DecodeGeometry:
  """The most K/V slots (2 to ``max_stages``) with which :data:`BLOCKS_PER_SM` blocks fit in
  an SM's shared memory (``finish``: :meth:`DecodeGeometry.smem_bytes`)."""
  best = DecodeGeometry(group, block_size, head_size, stages=2)
  for stages in range(3, max_stages + 1):
    geo = dataclasses.replace(best, stages=stages)
    if geo.smem_bytes(ops, finish) * BLOCKS_PER_SM > SMEM_BUDGET:
      break
    best = geo
  return best


def num_splits_for(num_seqs: int, num_kv_heads: int, max_steps: int,
                   num_sms: int = 132) -> int:
  """Splits per (sequence, KV head), from static shapes: :data:`BLOCKS_PER_SM` blocks per SM
  at a time, so pick the fewest splits whose waves of blocks come within 5 % of the best fill
  of the GPU (a split is one more partial to merge), with at most 64 splits and at least 4
  key steps (of ``max_steps``) a split."""
  base = max(1, num_seqs * num_kv_heads)
  slots = BLOCKS_PER_SM * num_sms
  cands = range(1, max(1, min(64, max_steps // 4)) + 1)
  cost = {k: cdiv(base * k, slots) / k for k in cands}
  best = min(cost.values())
  return min(k for k in cands if cost[k] <= 1.05 * best)
