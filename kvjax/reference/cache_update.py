"""Reference cache write by slot mapping, pure jnp (spec §4, §5): the oracle of the write kernels."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from kvjax import formats as F
from kvjax import quant
from kvjax.slots import int32_slots
from kvjax.spec import KVCacheSpec


def encode_rows(key, value, spec: KVCacheSpec, k_scale=None, v_scale=None):
  """Quantize new tokens into the bytes the cache stores.

  key, value: ``[T, H, D]`` in ``spec.dtype``.
  Returns, for every format but nvfp4, the packed content rows ``[T, H, C]`` in the
  storage dtype (``[K data | K scale | V data | V scale]`` per row). For nvfp4,
  ``((k_data [T, H, D/2], k_sf [T, H, D/16]), (v_data, v_sf))`` (scales in logical order).
  """
  fmt = spec.format
  if fmt.kind == F.NVFP4:
    return quant.quantize_nvfp4(key, k_scale), quant.quantize_nvfp4(value, v_scale)
  if fmt.kind == F.PLAIN:
    sides = [key.astype(spec.storage_dtype), value.astype(spec.storage_dtype)]
  elif fmt.kind == F.FP8_PER_TENSOR:
    sides = [quant.quantize_fp8_per_tensor(key, k_scale, spec.storage_dtype),
             quant.quantize_fp8_per_tensor(value, v_scale, spec.storage_dtype)]
  else:
    sides = []
    for x in (key, value):
      data, scale = quant.quantize_per_token_head(x, fmt)
      sides += [data, quant.scale_to_storage(scale, spec.storage_dtype)]
  return jnp.concatenate(sides, axis=-1)


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
  Out-of-range slots are dropped (the public ``write_kv`` rejects them eagerly).
  """
  t = slot_mapping.shape[0]
  key, value = key[:t], value[:t]
  num_blocks = cache.shape[0]
  block, off = split_slots(slot_mapping, spec, num_blocks)
  rows = encode_rows(key, value, spec, k_scale, v_scale)
  if spec.format.kind == F.NVFP4:
    return _write_nvfp4(cache, rows, block, off, spec)
  bits, rows = quant.to_bits(cache), quant.to_bits(rows)     # scatter bits, never floats
  if spec.layout == "NHD":
    bits = bits.at[block, off].set(rows, mode="drop")
  else:
    bits = bits.at[block, :, off].set(rows, mode="drop")
  return quant.from_bits(bits, cache.dtype)


def _write_nvfp4(cache, rows, block, off, spec: KVCacheSpec):
  """nvfp4 HND: per (page, side) the bytes are [data (H, N, D/2) | scales (H, N, S)]."""
  b, h, n = cache.shape[0], spec.num_kv_heads, spec.block_size
  d2, s = spec.head_size // 2, spec.num_scales_per_row
  sides = cache.reshape(b, 2, h * n * (d2 + s))
  out = []
  for i, (data, sf) in enumerate(rows):
    side = sides[:, i]
    pdata = side[:, :h * n * d2].reshape(b, h, n, d2).at[block, :, off].set(data, mode="drop")
    sf_bytes = jax.lax.bitcast_convert_type(sf, jnp.uint8)
    pscale = side[:, h * n * d2:].reshape(b, h, n * s)
    if i == 1 and quant.nvfp4_v_scales_swizzled(n, s):
      pos = jnp.asarray(quant.nvfp4_v_swizzle_index(n, s))[off]          # [T, S]
      pscale = pscale.at[block[:, None], :, pos].set(
          jnp.swapaxes(sf_bytes, 1, 2), mode="drop")                      # values [T, S, H]
    else:
      pos = off[:, None] * s + jnp.arange(s)[None, :]
      pscale = pscale.at[block[:, None], :, pos].set(jnp.swapaxes(sf_bytes, 1, 2), mode="drop")
    out.append(jnp.concatenate([pdata.reshape(b, -1), pscale.reshape(b, -1)], axis=-1))
  return jnp.stack(out, axis=1).reshape(cache.shape)
