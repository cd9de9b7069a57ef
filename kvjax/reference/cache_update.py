"""Reference cache write by slot mapping, pure jnp: the oracle of the write kernels.

The format's codec encodes the rows and stores them (:mod:`kvjax.codecs`); this module
splits slots into (block, offset) and drops the ones outside the cache. Like every
implementation it encodes key and value as given: for a rotated format (int4 per token-head)
``kvjax.write_kv`` rotates them first.
"""
from __future__ import annotations

import jax.numpy as jnp

from kvjax.slots import int32_slots
from kvjax.spec import KVCacheSpec


def encode_rows(key, value, spec: KVCacheSpec, k_scale=None, v_scale=None):
  """Quantize new tokens into the bytes the cache stores.

  key, value: ``[T, H, D]`` in ``spec.dtype``.
  Returns, for every format but nvfp4, the packed content rows ``[T, H, C]`` in the
  storage dtype (``[K data | K scale | V data | V scale]`` per row). For nvfp4,
  ``((k_data [T, H, D/2], k_sf [T, H, D/16]), (v_data, v_sf))`` (scales in logical order).
  """
  return spec.codec.encode(key, value, spec, k_scale, v_scale)


def split_slots(slot_mapping, spec: KVCacheSpec, num_blocks: int):
  """(block ids, offsets) of each slot; slots outside ``[0, num_blocks * block_size)`` get
  block id ``num_blocks`` (dropped by the scatter)."""
  slots = int32_slots(slot_mapping, num_blocks * spec.block_size)
  bad = (slots < 0) | (slots >= num_blocks * spec.block_size)
  block = jnp.where(bad, num_blocks, slots // spec.block_size)
  return block, jnp.where(bad, 0, slots % spec.block_size)


def write_kv(cache, key, value, slot_mapping, spec: KVCacheSpec, k_scale=None, v_scale=None):
  """Scatter new tokens into the physical cache; returns the new cache.

  cache: the spec's physical array. key, value: ``[T', H, D]`` with
  ``T' >= T = len(slot_mapping)``; slot_mapping: int ``[T]``, negative = skip.
  Out-of-range slots are dropped (the public ``write_kv`` rejects them eagerly). Bytes not
  named by a slot keep every bit (the codecs scatter bits, not floats).
  """
  t = slot_mapping.shape[0]
  block, off = split_slots(slot_mapping, spec, cache.shape[0])
  encoded = encode_rows(key[:t], value[:t], spec, k_scale, v_scale)
  return spec.codec.scatter(cache, encoded, block, off, spec)
