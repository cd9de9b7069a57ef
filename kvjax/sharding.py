"""KV caches sharded over a tensor-parallel mesh axis (one shard = one TP rank's cache).

The global array is the spec's physical cache with ``H`` = total KV heads; the KV-head
axis (NHD dim 2, HND dim 1) is split over the mesh axis, so shard ``i`` holds heads
``[i*H/tp, (i+1)*H/tp)`` and *is* rank i's per-rank cache (spec with ``H/tp`` heads).
Ops run the per-rank op on each shard under ``shard_map``; query heads split the same
way (shard i gets query heads ``[i*Hq/tp, (i+1)*Hq/tp)``, which read exactly its KV heads
under GQA), and so do sinks.

nvfp4 is refused: its 2H head-slot axis is K heads then V heads, so an even split of
that axis gives the first ranks only K heads and the last only V heads; and within a
side the bytes are [data of all heads | scales of all heads], so no axis of the physical
array is a head axis at all. A per-rank nvfp4 cache ([its K data | its K scales | its V
data | its V scales]) is not a slice of the global array: keep nvfp4 caches as per-rank
arrays (kvjax.transfer moves them between TP groups).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from kvjax import validation as V
from kvjax.attention import check_attention_args, unified_attention
from kvjax.cache_ops import write_kv
from kvjax.spec import KVCacheSpec, MLACacheSpec


def _shard_map_fn():
  """(shard_map, name of its replication-check flag) on jax 0.10 / 0.11 (or older)."""
  fn = getattr(jax, "shard_map", None)
  if fn is None:  # jax < 0.7
    from jax.experimental.shard_map import shard_map as fn  # pylint: disable=import-outside-toplevel
  params = inspect.signature(fn).parameters
  flag = "check_vma" if "check_vma" in params else "check_rep"
  return fn, flag


def shard_map(f, mesh, in_specs, out_specs):
  """``shard_map`` with the replication check off, across jax versions."""
  fn, flag = _shard_map_fn()
  return fn(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **{flag: False})


def _axis_size(mesh, axis: str) -> int:
  if axis not in mesh.axis_names:
    raise ValueError(f"axis={axis!r} is not a mesh axis; the mesh has {mesh.axis_names}")
  return mesh.shape[axis]


def head_dim(spec: KVCacheSpec) -> int:
  """Physical axis of KV heads: 2 for NHD ``(B, N, H, C)``, 1 for HND ``(B, H, N, C)``."""
  return 2 if spec.layout == "NHD" else 1


def cache_partition_spec(spec: KVCacheSpec, axis: str = "tp") -> P:
  """PartitionSpec that splits the physical KV-head axis over ``axis``."""
  dims = [None] * 4
  dims[head_dim(spec)] = axis
  return P(*dims)


def check_shardable(spec: KVCacheSpec, tp: int) -> None:
  if not isinstance(spec, KVCacheSpec):
    raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
  if not spec.codec.content_halves:
    raise ValueError(
        f"{spec.cache_dtype} caches cannot be sharded by splitting the head-slot axis: its 2H "
        "slots are K "
        "heads then V heads (each shard would hold only K or only V heads) and each side is "
        "[data of all heads | scales of all heads]. Keep nvfp4 caches per rank (a list of "
        "per-rank arrays, see kvjax.transfer)")
  if spec.num_kv_heads % tp:
    raise ValueError(f"num_kv_heads={spec.num_kv_heads} (total) is not a multiple of the mesh "
                     f"axis size {tp}; replicated KV (tp > H) is kept per rank, not sharded")


def shard_spec(spec: KVCacheSpec, tp: int) -> KVCacheSpec:
  """The per-shard (per-rank) spec: ``num_kv_heads // tp`` heads."""
  check_shardable(spec, tp)
  return dataclasses.replace(spec, num_kv_heads=spec.num_kv_heads // tp)


def cache_sharding(mesh, spec, axis: str = "tp") -> NamedSharding:
  """NamedSharding of a cache over ``mesh``: KV heads split over ``axis``.

  ``spec`` is the global spec (``num_kv_heads`` = total H). An MLA spec has no heads:
  its cache is replicated. Pass the result to ``spec.allocate(num_blocks, sharding=...)``.
  """
  tp = _axis_size(mesh, axis)
  if isinstance(spec, MLACacheSpec):
    return NamedSharding(mesh, P())
  check_shardable(spec, tp)
  return NamedSharding(mesh, cache_partition_spec(spec, axis))


def _scale_spec(scale, axis):
  """Global scales: scalars replicate, per-head [H] scales split with the heads."""
  if scale is None:
    return None
  return P(axis) if jax.numpy.ndim(scale) == 1 and jax.numpy.shape(scale)[0] > 1 else P()


def sharded_write_kv(cache, key, value, slot_mapping, spec: KVCacheSpec, mesh, *, axis="tp",
                     k_scale=None, v_scale=None, impl: str = "auto", interpret=None):
  """:func:`kvjax.write_kv` on a head-sharded cache, each shard writing its own heads.

  cache: the global physical array (``spec``, H total heads), sharded by
  :func:`cache_sharding`; key, value: ``[T, H, D]`` (split over heads);
  slot_mapping: int ``[T]`` (replicated). fp8 per-tensor ``[H]`` scales split with heads.
  Returns the new global cache with the same sharding.
  """
  tp = _axis_size(mesh, axis)
  local = shard_spec(spec, tp)
  num_blocks = spec.num_blocks_of(cache)
  slot_mapping = V.check_slots(slot_mapping, num_blocks * spec.block_size)
  V.check_kv_tokens(spec, key, value, slot_mapping.shape[0])
  V.check_scales(spec, k_scale, v_scale)
  fn = _write_fn(local, mesh, axis, _scale_spec(k_scale, axis), _scale_spec(v_scale, axis), impl,
                 interpret)
  return fn(cache, key, value, slot_mapping, k_scale, v_scale)


@functools.lru_cache(maxsize=64)
def _write_fn(local: KVCacheSpec, mesh, axis, ks, vs, impl, interpret):
  """The jitted shard_map of write_kv, built once per static configuration."""
  cspec = cache_partition_spec(local, axis)
  kv = P(None, axis, None)

  def per_shard(c, k, v, s, k_sc, v_sc):
    return write_kv(c, k, v, s, local, k_scale=k_sc, v_scale=v_sc, impl=impl,
                    interpret=interpret)

  return jax.jit(shard_map(per_shard, mesh, (cspec, kv, kv, P(), ks, vs), cspec))


def sharded_unified_attention(q, cache, spec: KVCacheSpec, mesh, *, query_start_loc, seq_lens,
                              block_table, scale, axis="tp", causal=True, sliding_window=None,
                              soft_cap=None, sinks=None, k_scale=None, v_scale=None,
                              max_query_len=None, impl: str = "auto", interpret=None):
  """:func:`kvjax.unified_attention` on a head-sharded cache, one shard per TP rank.

  q: ``[T, Hq, D]`` split over query heads (Hq / tp per shard, the ones that read the
  shard's KV heads); sinks ``[Hq]`` split the same way; metadata replicated.
  Returns ``[T, Hq, D]`` sharded over query heads.
  """
  tp = _axis_size(mesh, axis)
  local = shard_spec(spec, tp)
  check_attention_args(q, cache, spec, query_start_loc, seq_lens, block_table, sliding_window,
                       soft_cap, sinks)
  V.check_scales(spec, k_scale, v_scale)
  fn = _attention_fn(local, mesh, axis, sinks is not None, _scale_spec(k_scale, axis),
                     _scale_spec(v_scale, axis), float(scale), bool(causal), sliding_window,
                     None if soft_cap is None else float(soft_cap), max_query_len, impl,
                     interpret)
  return fn(q, cache, query_start_loc, seq_lens, block_table, sinks, k_scale, v_scale)


@functools.lru_cache(maxsize=64)
def _attention_fn(local: KVCacheSpec, mesh, axis, has_sinks, ks, vs, scale, causal,
                  sliding_window, soft_cap, max_query_len, impl, interpret):
  """The jitted shard_map of unified_attention, built once per static configuration."""
  cspec = cache_partition_spec(local, axis)
  qspec = P(None, axis, None)
  sspec = P(axis) if has_sinks else None

  def per_shard(q_, c, qsl, sl, bt, sk, k_sc, v_sc):
    return unified_attention(q_, c, local, query_start_loc=qsl, seq_lens=sl, block_table=bt,
                             scale=scale, causal=causal, sliding_window=sliding_window,
                             soft_cap=soft_cap, sinks=sk, k_scale=k_sc, v_scale=v_sc,
                             max_query_len=max_query_len, impl=impl, interpret=interpret)

  return jax.jit(shard_map(per_shard, mesh, (qspec, cspec, P(), P(), P(), sspec, ks, vs), qspec))


def rank_caches(cache, spec: KVCacheSpec, mesh, axis: str = "tp"):
  """Per-rank arrays (shard i = rank i's cache, on its device) of a head-sharded cache.

  The bridge to :func:`kvjax.transfer.transfer_blocks`, which takes per-rank lists.
  """
  tp = _axis_size(mesh, axis)
  check_shardable(spec, tp)
  dim = head_dim(spec)
  per = spec.num_kv_heads // tp
  by_start = {}
  for shard in cache.addressable_shards:
    start = shard.index[dim].start or 0
    by_start.setdefault(start, shard.data)
  if sorted(by_start) != [i * per for i in range(tp)]:
    raise ValueError(f"cache is not split into {tp} head shards of {per} along dim {dim}")
  return [by_start[i * per] for i in range(tp)]


def from_rank_caches(caches, spec: KVCacheSpec, mesh, axis: str = "tp"):
  """The global head-sharded array from per-rank caches on the mesh's devices (in order)."""
  tp = _axis_size(mesh, axis)
  check_shardable(spec, tp)
  if len(caches) != tp:
    raise ValueError(f"need {tp} per-rank caches, got {len(caches)}")
  sharding = cache_sharding(mesh, spec, axis)
  shape = spec.physical_shape(caches[0].shape[0])
  dim = head_dim(spec)
  per = spec.num_kv_heads // tp
  arrays = []
  for dev, idx in sharding.addressable_devices_indices_map(shape).items():
    rank = (idx[dim].start or 0) // per
    arrays.append(jax.device_put(caches[rank], dev))
  return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


__all__ = ["cache_sharding", "cache_partition_spec", "shard_spec", "sharded_write_kv",
           "sharded_unified_attention", "rank_caches", "from_rank_caches", "shard_map", "head_dim"]
