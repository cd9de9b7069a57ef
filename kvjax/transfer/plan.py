"""Byte-level read plans that fill one local page from remote pages (docs/layout.md §7).

A plan is a list of :class:`Read`: byte ranges *within one page*. The same plan
applies to every block of a request and every layer (region), so descriptors are
the plan replicated over (region, block) pairs.

Head slicing is by contiguous bytes, valid for HND pages only:
- plain / fp8 / per-token-head HND: head ``j`` of a page is bytes
  ``[j*N*C*ds, (j+1)*N*C*ds)`` (C includes the scale slots of padded rows);
- nvfp4 (HND only): per page ``[K data (H,N,D/2) | K scales (H,N,S) | V data | V scales]``,
  so a head slice is 4 runs (data and scales of each side). V scales are swizzled
  per (block, head) tile of N x S, so whole-head runs keep tiles intact;
- MLA: no heads; the whole page from one rank (replicated).
NHD pages interleave heads per token: heterogeneous head counts are refused here
(:mod:`kvjax.transfer.execute` permutes NHD pages on receive instead).
"""
from __future__ import annotations

import dataclasses
from typing import List, NamedTuple, Optional, Sequence

import numpy as np

from kvjax import spec as S
from kvjax.transfer import topology as T


class Read(NamedTuple):
  """Copy ``length`` bytes at ``remote_offset`` of a page of remote rank ``remote_rank``
  to ``local_offset`` of the local page (offsets in bytes within one page)."""
  remote_rank: int
  remote_offset: int
  length: int
  local_offset: int


class HeadRun(NamedTuple):
  """``count`` consecutive KV heads: remote page heads ``remote_head..`` -> local ``local_head..``."""
  remote_rank: int
  remote_head: int
  local_head: int
  count: int


def _is_mla(spec, is_mla: bool) -> bool:
  return bool(is_mla) or isinstance(spec, S.MLACacheSpec)


def head_runs(tp_rank: int, tp_size: int, remote_tp_size: int,
              total_num_kv_heads: int) -> List[HeadRun]:
  """The docs/layout.md §7 rule as runs of heads (before any byte layout is applied)."""
  h_local = T.heads_per_rank(total_num_kv_heads, tp_size)
  h_remote = T.heads_per_rank(total_num_kv_heads, remote_tp_size)
  srcs = T.source_ranks(tp_rank, tp_size, remote_tp_size, total_num_kv_heads)
  if tp_size >= remote_tp_size:
    factor = T.rank_offset_factor(tp_rank, tp_size, remote_tp_size, total_num_kv_heads)
    return [HeadRun(srcs[0], factor * h_local, 0, h_local)]
  runs = [HeadRun(src, 0, i * h_remote, h_remote) for i, src in enumerate(srcs)]
  if len(runs) * h_remote != h_local:  # cannot happen when the sizes divide
    raise ValueError(f"remote ranks {srcs} hold {len(runs) * h_remote} heads, not {h_local}")
  return runs


def _runs_to_reads(runs: Sequence[HeadRun], spec: S.KVCacheSpec, h_local: int,
                   h_remote: int) -> List[Read]:
  """One read per (head run, page segment) (:meth:`kvjax.codecs.Codec.head_segments`): a
  segment holds every head's part in head order, so a run of heads is one byte run in it."""
  segments = spec.codec.head_segments(spec)
  reads = []
  for run in runs:
    r_start = l_start = 0
    for head_bytes in segments:
      reads.append(Read(run.remote_rank, r_start + run.remote_head * head_bytes,
                        run.count * head_bytes, l_start + run.local_head * head_bytes))
      r_start, l_start = r_start + h_remote * head_bytes, l_start + h_local * head_bytes
  return reads


def check_covers(reads: Sequence[Read], local_page_bytes: int, remote_page_bytes: int) -> None:
  """Reads must tile the local page exactly and stay inside the remote page."""
  pos = 0
  for r in sorted(reads, key=lambda r: r.local_offset):
    if r.local_offset != pos or r.length <= 0:
      raise ValueError(f"read plan does not tile the local page at byte {pos}: {list(reads)}")
    if r.remote_offset < 0 or r.remote_offset + r.length > remote_page_bytes:
      raise ValueError(f"read {r} leaves the remote page of {remote_page_bytes} bytes")
    pos += r.length
  if pos != local_page_bytes:
    raise ValueError(f"read plan covers {pos} bytes, the local page has {local_page_bytes}")


def plan_reads(spec, *, tp_rank: int, tp_size: int, remote_tp_size: int,
               total_num_kv_heads: int, is_mla: bool = False) -> List[Read]:
  """Reads that fill one local page of rank ``tp_rank`` from the remote side's pages.

  Args:
    spec: the local (this rank's) :class:`kvjax.KVCacheSpec`; its ``num_kv_heads``
      must be the local head count (``H / tp``, or 1 when ``tp > H``). An
      :class:`kvjax.MLACacheSpec` (or ``is_mla=True``) plans a replicated whole-page read.
    tp_rank, tp_size: this rank and this side's TP size.
    remote_tp_size: the other side's TP size; its ranks hold pages of the same format
      and layout with their own head count.
    total_num_kv_heads: H, the model's KV heads.
  Returns:
    :class:`Read` list sorted by local offset; the reads tile the local page.
  Raises:
    ValueError for sizes that do not divide, a spec whose head count is not this
    rank's, or NHD pages with different head counts on the two sides.
  """
  probe_mla = _is_mla(spec, is_mla)
  T.probe_layout(is_mla=probe_mla)
  if probe_mla:
    T.check_topology(tp_rank, tp_size, remote_tp_size, 1, is_mla=True)
    src = T.source_ranks(tp_rank, tp_size, remote_tp_size, 1, is_mla=True)[0]
    return [Read(src, 0, spec.page_bytes, 0)]
  if not isinstance(spec, S.KVCacheSpec):
    raise TypeError(f"spec must be a KVCacheSpec or MLACacheSpec, got {type(spec).__name__}")
  T.check_topology(tp_rank, tp_size, remote_tp_size, total_num_kv_heads)
  h_local = T.heads_per_rank(total_num_kv_heads, tp_size)
  h_remote = T.heads_per_rank(total_num_kv_heads, remote_tp_size)
  if spec.num_kv_heads != h_local:
    raise ValueError(f"spec.num_kv_heads={spec.num_kv_heads} is not the local head count "
                     f"{h_local} of tp_size={tp_size} with total_num_kv_heads={total_num_kv_heads}")
  if spec.layout == "NHD" and h_local != h_remote:
    raise ValueError(
        f"NHD pages interleave heads per token: a {h_remote}-head remote page cannot be "
        f"sliced into {h_local}-head local pages by contiguous bytes. Use HND caches, or "
        "kvjax.transfer.transfer_blocks, which permutes NHD pages on receive")
  runs = head_runs(tp_rank, tp_size, remote_tp_size, total_num_kv_heads)
  reads = sorted(_runs_to_reads(runs, spec, h_local, h_remote), key=lambda r: r.local_offset)
  rspec = T.remote_spec(spec, remote_tp_size, total_num_kv_heads)
  check_covers(reads, spec.page_bytes, rspec.page_bytes)
  return reads


@dataclasses.dataclass(frozen=True)
class RegionDescriptor:
  """One whole page of one region (layer tensor): id = region * num_blocks + block."""
  desc_id: int
  region: int
  block: int
  offset: int   # byte offset of the page within the region
  length: int   # page bytes


class BlockRead(NamedTuple):
  """One read of a transfer: remote rank, byte offset within the remote region, length,
  byte offset within the local region, and the two pages' descriptor ids."""
  remote_rank: int
  remote_offset: int
  length: int
  local_offset: int
  local_desc_id: int
  remote_desc_id: int


def region_descriptors(page_bytes: int, num_blocks: int, num_regions: int) -> List[RegionDescriptor]:
  """Whole-page descriptors of ``num_regions`` regions of ``num_blocks`` pages each."""
  page_bytes = T._positive_int("page_bytes", page_bytes)
  num_blocks = T._positive_int("num_blocks", num_blocks)
  num_regions = T._positive_int("num_regions", num_regions)
  return [RegionDescriptor(r * num_blocks + b, r, b, b * page_bytes, page_bytes)
          for r in range(num_regions) for b in range(num_blocks)]


def _check_block_ids(name: str, ids, num_blocks: int) -> np.ndarray:
  ids = np.asarray(ids)
  if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
    raise ValueError(f"{name} must be a 1-D integer sequence, got {ids!r}")
  if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
    raise ValueError(f"{name} must lie in [0, {num_blocks}), got {ids.tolist()}")
  return ids.astype(np.int64)


def descriptors(spec, *, num_blocks: int, num_regions: int, block_ids, remote_block_ids,
                tp_rank: int, tp_size: int, remote_tp_size: int, total_num_kv_heads: int,
                remote_num_blocks: Optional[int] = None, is_mla: bool = False) -> List[BlockRead]:
  """The reads of a request over all regions (layers), in (region, block, read) order.

  ``block_ids[i]`` (local) receives ``remote_block_ids[i]`` (remote). Offsets are bytes
  within a region tensor (``block * page_bytes + read offset``); descriptor ids are
  ``region * num_blocks + block`` on each side (remote with ``remote_num_blocks``).
  Count = ``num_regions * len(block_ids) * len(plan_reads(...))``.
  """
  num_blocks = T._positive_int("num_blocks", num_blocks)
  num_regions = T._positive_int("num_regions", num_regions)
  remote_num_blocks = num_blocks if remote_num_blocks is None else T._positive_int(
      "remote_num_blocks", remote_num_blocks)
  local_ids = _check_block_ids("block_ids", block_ids, num_blocks)
  remote_ids = _check_block_ids("remote_block_ids", remote_block_ids, remote_num_blocks)
  if local_ids.shape != remote_ids.shape:
    raise ValueError(f"block_ids ({local_ids.size}) and remote_block_ids ({remote_ids.size}) "
                     "must have the same length")
  reads = plan_reads(spec, tp_rank=tp_rank, tp_size=tp_size, remote_tp_size=remote_tp_size,
                     total_num_kv_heads=total_num_kv_heads, is_mla=is_mla)
  local_page = spec.page_bytes
  remote_page = (spec.page_bytes if _is_mla(spec, is_mla)
                 else T.remote_spec(spec, remote_tp_size, total_num_kv_heads).page_bytes)
  out = []
  for region in range(num_regions):
    for lb, rb in zip(local_ids.tolist(), remote_ids.tolist()):
      for r in reads:
        out.append(BlockRead(r.remote_rank, rb * remote_page + r.remote_offset, r.length,
                             lb * local_page + r.local_offset, region * num_blocks + lb,
                             region * remote_num_blocks + rb))
  return out


__all__ = ["Read", "HeadRun", "head_runs", "plan_reads", "check_covers", "RegionDescriptor",
           "BlockRead", "region_descriptors", "descriptors"]
