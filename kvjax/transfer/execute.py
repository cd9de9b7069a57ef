"""Execute read plans between device groups with ``jax.device_put`` (docs/layout.md §7).

One layer at a time. The prefill side is a list of per-rank caches (rank ``p`` on
its device, ``H / P`` heads or one replicated head), the decode side likewise.
A transfer of a request's blocks is, per decode rank:

1. gather the request's pages from each source rank's cache as bytes
   (uint8 ``[n, remote_page_bytes]``, on the source device) and keep only the byte runs
   the plan reads (so each decode rank receives exactly its page bytes);
2. ``jax.device_put`` them to the decode device;
3. assemble local pages by the plan's byte reads (uint8 ``[n, local_page_bytes]``);
4. scatter them into the decode cache at the decode request's block ids.

NHD with different head counts on the two sides is done by permute-on-receive:
received NHD pages are transposed to HND, the HND plan applies, and the
assembled pages are transposed back to NHD before the scatter.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Dict, List, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import pages as kv_pages
from kvjax import spec as S
from kvjax.transfer import plan as PL
from kvjax.transfer import topology as T


# -- bytes views -----------------------------------------------------------------------------
def to_bytes(x):
  """Any array ``[n, ...]`` -> its bytes, uint8 ``[n, prod(...) * itemsize]``."""
  n = x.shape[0]
  if x.dtype != jnp.uint8:
    x = jax.lax.bitcast_convert_type(x, jnp.uint8)
  return x.reshape(n, -1)


def from_bytes(b, shape, dtype):
  """uint8 ``[n, page_bytes]`` -> array ``[n, *shape]`` of ``dtype`` (inverse of to_bytes)."""
  dtype = np.dtype(dtype)
  n = b.shape[0]
  if dtype == np.uint8:
    return b.reshape((n,) + tuple(shape))
  if dtype.itemsize == 1:
    return jax.lax.bitcast_convert_type(b, dtype).reshape((n,) + tuple(shape))
  b = b.reshape((n,) + tuple(shape) + (dtype.itemsize,))
  return jax.lax.bitcast_convert_type(b, dtype)


@jax.jit
def gather_page_bytes(cache, block_ids):
  """Pages ``cache[block_ids]`` as bytes: uint8 ``[len(block_ids), page_bytes]``."""
  return to_bytes(cache[block_ids])


@functools.partial(jax.jit, donate_argnums=0)
def scatter_page_bytes(cache, pages, block_ids):
  """Write byte pages (uint8 ``[n, page_bytes]``) into ``cache`` at distinct ``block_ids``;
  donated: in place, bit for bit (:func:`kvjax.pages.store_pages`)."""
  table = cache.reshape(cache.shape[0], -1)
  return kv_pages.store_pages(table, pages, block_ids).reshape(cache.shape)


@functools.partial(jax.jit, static_argnums=(1,))
def _assemble(sources, reads):
  parts = [sources[r.remote_rank][:, r.remote_offset:r.remote_offset + r.length] for r in reads]
  return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def assemble_pages(sources: Dict[int, jax.Array], reads: Sequence[PL.Read]) -> jax.Array:
  """Local pages from received remote pages by byte reads.

  sources: remote rank -> uint8 ``[n, remote_page_bytes]`` (all on one device);
  reads: a plan that tiles the local page (as from :func:`plan_reads`).
  Returns uint8 ``[n, local_page_bytes]``.
  """
  reads = tuple(sorted(reads, key=lambda r: r.local_offset))
  return _assemble({int(k): v for k, v in sources.items()}, reads)


# -- NHD permute-on-receive -------------------------------------------------------------------
def hnd_twin(spec: S.KVCacheSpec) -> S.KVCacheSpec:
  """The same cache with HND pages (what NHD pages are permuted to on receive)."""
  return dataclasses.replace(spec, layout="HND")


@functools.partial(jax.jit, static_argnums=(1, 2))
def permute_page_bytes(pages, spec: S.KVCacheSpec, to_layout: str):
  """Byte pages of ``spec`` (NHD or HND) -> the same pages in ``to_layout``."""
  shape = spec.physical_shape(1)[1:]
  x = from_bytes(pages, shape, spec.storage_dtype)
  if spec.layout != to_layout:
    x = jnp.swapaxes(x, 1, 2)
  return to_bytes(x)


def needs_permute(spec, remote_tp_size: int, total_num_kv_heads: int, tp_size: int,
                  is_mla: bool = False) -> bool:
  """True when NHD pages must be permuted on receive (head counts differ)."""
  if is_mla or isinstance(spec, S.MLACacheSpec) or spec.layout != "NHD":
    return False
  return (T.heads_per_rank(total_num_kv_heads, tp_size)
          != T.heads_per_rank(total_num_kv_heads, remote_tp_size))


def rank_plan(spec, *, tp_rank: int, tp_size: int, remote_tp_size: int, total_num_kv_heads: int,
              is_mla: bool = False):
  """(reads, permute) for a rank: the plan, on the HND twin when NHD must be permuted."""
  permute = needs_permute(spec, remote_tp_size, total_num_kv_heads, tp_size, is_mla)
  plan_spec = hnd_twin(spec) if permute else spec
  reads = PL.plan_reads(plan_spec, tp_rank=tp_rank, tp_size=tp_size,
                        remote_tp_size=remote_tp_size, total_num_kv_heads=total_num_kv_heads,
                        is_mla=is_mla)
  return reads, permute


def receive_into(cache, spec, sources: Dict[int, jax.Array], reads, dst_block_ids, *,
                 permute: bool, remote_spec=None):
  """Assemble local pages from received remote byte pages and scatter them into ``cache``.

  sources: remote rank -> uint8 ``[n, remote_page_bytes]`` (moved to ``cache``'s device).
  permute: NHD pages -> HND before the reads, back to NHD after (needs ``remote_spec``).
  Returns the new cache (``cache`` is donated).
  """
  pages = receive_pages(_device_of(cache), spec, sources, reads, permute=permute,
                        remote_spec=remote_spec)
  return scatter_page_bytes(cache, pages, np.asarray(dst_block_ids, np.int32))


def receive_pages(dev, spec, sources: Dict[int, jax.Array], reads, *, permute: bool,
                  remote_spec=None) -> jax.Array:
  """The local pages (uint8 ``[n, spec.page_bytes]`` on ``dev``) that received remote byte
  pages (remote rank -> uint8 ``[n, remote_page_bytes]``) assemble to by ``reads``."""
  sources = {k: jax.device_put(v, dev) for k, v in sources.items()}
  return assemble_received(spec, sources, reads, permute=permute, remote_spec=remote_spec)


def assemble_received(spec, sources: Dict[int, jax.Array], reads, *, permute: bool,
                      remote_spec=None) -> jax.Array:
  """:func:`receive_pages` of sources already on the device (traceable inside a jit)."""
  if permute:
    sources = {k: permute_page_bytes(v, remote_spec, "HND") for k, v in sources.items()}
  pages = assemble_pages(sources, reads)
  if permute:
    pages = permute_page_bytes(pages, hnd_twin(spec), "NHD")
  return pages


def storage_dtype(spec) -> np.dtype:
  """dtype of a per-rank cache array of ``spec`` (KV or MLA)."""
  return np.dtype(spec.dtype if isinstance(spec, S.MLACacheSpec) else spec.storage_dtype)


def check_rank_caches(side: str, caches, spec) -> None:
  """Every per-rank cache has the spec's page shape and storage dtype, and equal block counts."""
  want = tuple(spec.physical_shape(1)[1:])
  for i, c in enumerate(caches):
    if tuple(c.shape[1:]) != want or np.dtype(c.dtype) != storage_dtype(spec):
      raise ValueError(f"{side} cache of rank {i} has shape {tuple(c.shape)} {c.dtype}, not the "
                       f"{side} per-rank pages {want} {storage_dtype(spec)}")
    if c.shape[0] != caches[0].shape[0]:
      raise ValueError(f"{side} caches disagree on num_blocks: {c.shape[0]} vs {caches[0].shape[0]}")


def _device_of(x) -> jax.Device:
  devs = list(x.devices())
  if len(devs) != 1:
    raise ValueError(f"each per-rank cache must live on one device, got {devs}")
  return devs[0]


def _check_block_ids_distinct(dst_block_ids, num_blocks: int) -> np.ndarray:
  dst = PL._check_block_ids("dst_block_ids", dst_block_ids, num_blocks)
  if len(set(dst.tolist())) != dst.size:
    raise ValueError(f"dst_block_ids must be distinct, got {dst.tolist()}")
  return dst.astype(np.int32)


def _check_ids(src_block_ids, dst_block_ids, src_blocks: int, dst_blocks: int):
  src = PL._check_block_ids("src_block_ids", src_block_ids, src_blocks)
  dst = _check_block_ids_distinct(dst_block_ids, dst_blocks)
  if src.shape != dst.shape:
    raise ValueError(f"src_block_ids ({src.size}) and dst_block_ids ({dst.size}) differ in length")
  return src.astype(np.int32), dst


def transfer_blocks(prefill_caches: Sequence[jax.Array], decode_caches: Sequence[jax.Array],
                    spec, src_block_ids, dst_block_ids, *, total_num_kv_heads: int,
                    is_mla: bool = False) -> List[jax.Array]:
  """Move a request's blocks of one layer from a prefill group to a decode group.

  Args:
    prefill_caches: P per-rank physical caches (rank p's on its device), each of the
      prefill per-rank spec (``spec`` with ``max(1, H/P)`` heads).
    decode_caches: D per-rank caches of ``spec`` (``max(1, H/D)`` heads), each on its device.
    spec: the decode per-rank :class:`kvjax.KVCacheSpec` (or :class:`kvjax.MLACacheSpec`).
    src_block_ids: the request's block ids on the prefill side.
    dst_block_ids: the block ids of the same pages on the decode side (distinct).
    total_num_kv_heads: H.
  Returns:
    The D new decode caches (inputs are donated); blocks not in ``dst_block_ids`` are untouched.
  """
  p, d = len(prefill_caches), len(decode_caches)
  if p == 0 or d == 0:
    raise ValueError("prefill_caches and decode_caches must be non-empty")
  mla = is_mla or isinstance(spec, S.MLACacheSpec)
  rspec = spec if mla else T.remote_spec(spec, p, total_num_kv_heads)
  for side, caches, sp in (("prefill", prefill_caches, rspec), ("decode", decode_caches, spec)):
    check_rank_caches(side, caches, sp)
  src, dst = _check_ids(src_block_ids, dst_block_ids, prefill_caches[0].shape[0],
                        decode_caches[0].shape[0])
  if src.size == 0:
    return list(decode_caches)
  gathered: Dict[int, jax.Array] = {}
  out = []
  for r, cache in enumerate(decode_caches):
    reads, permute = rank_plan(spec, tp_rank=r, tp_size=d, remote_tp_size=p,
                               total_num_kv_heads=total_num_kv_heads, is_mla=mla)
    dev = _device_of(cache)
    sources = {}
    if not permute:  # move only the bytes the plan reads: slice on the source device
      reads, sends = compact_reads(reads)
    for s in sorted({rd.remote_rank for rd in reads}):
      if s not in gathered:
        gathered[s] = gather_page_bytes(prefill_caches[s], src)
      chunk = gathered[s] if permute else slice_reads(gathered[s], sends[s])
      sources[s] = jax.device_put(chunk, dev)
    out.append(receive_into(cache, spec, sources, reads, dst, permute=permute, remote_spec=rspec))
  return out


def compact_reads(reads: Sequence[PL.Read]):
  """Split a plan into what each source sends and how the receiver reads it.

  Returns (reads over compact buffers, {remote rank: the reads it sends, in buffer order}):
  the sender concatenates its runs (:func:`slice_reads`), so only the local page's bytes
  move; the receiver's reads then index that compact buffer.
  """
  sends: Dict[int, List[PL.Read]] = {}
  compact = []
  for r in sorted(reads, key=lambda r: r.local_offset):
    runs = sends.setdefault(r.remote_rank, [])
    offset = sum(x.length for x in runs)
    runs.append(r)
    compact.append(PL.Read(r.remote_rank, offset, r.length, r.local_offset))
  return compact, {k: tuple(v) for k, v in sends.items()}


@functools.partial(jax.jit, static_argnums=(1,))
def slice_reads(pages, reads):
  """The bytes ``reads`` take from byte pages ``[n, page_bytes]``, concatenated: ``[n, sum]``."""
  parts = [pages[:, r.remote_offset:r.remote_offset + r.length] for r in reads]
  return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


__all__ = ["to_bytes", "from_bytes", "gather_page_bytes", "scatter_page_bytes", "assemble_pages",
           "hnd_twin", "permute_page_bytes", "needs_permute", "rank_plan", "receive_into",
           "receive_pages", "assemble_received", "transfer_blocks", "compact_reads", "slice_reads"]
