"""Public cache writes and reads: ``write_kv`` and ``read_kv`` (docs/layout.md §4, §5)."""
from __future__ import annotations

import jax.numpy as jnp

from kvjax import registry
from kvjax import validation as V
from kvjax.layers import Stack
from kvjax.spec import KVCacheSpec


def write_kv(cache, key, value, slot_mapping, spec: KVCacheSpec, *, k_scale=None, v_scale=None,
             impl: str = "auto", interpret=None, layer=None):
  """Write new tokens' K/V into the cache by slot mapping; returns the new cache.

  Args:
    cache: the spec's physical array (``spec.physical_shape(B)``, ``spec.storage_dtype``), or
      a layered one (``spec.physical_shape(B, L)``) with ``layer``.
    key, value: ``[T', H, D]`` in ``spec.dtype``; only the first ``len(slot_mapping)``
      tokens are written.
    slot_mapping: int ``[T]``: ``block * block_size + offset``; negative = skip.
    k_scale, v_scale: global scales (fp8 per-tensor: scalar or [H]; nvfp4: scalar).
    impl: "auto" or a name in ``kvjax.registry.WRITE`` ("pallas" = the Triton kernel,
      "reference"); interpret: Pallas interpret mode (None: where the kernel is not native).
      ``kvjax.explain("write", spec)`` says which implementation runs and why.
    layer: with a layered cache, the layer written: a Python int or an int32 scalar (traced
      under jit: one program for every layer; outside ``[0, L)`` it writes nothing). Slots
      are the layer's own (``block * block_size + offset``); only that layer's rows change
      (:mod:`kvjax.layers`).
  Pure: under ``jax.jit`` with the cache donated, the write happens in place.
  Quantize-on-write for every cache dtype; blocks not named by a slot are untouched. A format
  that stores rotated rows (int4 per token-head: ``spec.codec.rotation``) gets key and value
  rotated here, before any implementation encodes them.
  """
  num_blocks = V.check_cache(spec, cache, layer)
  slot_mapping = V.check_slots(slot_mapping, num_blocks * spec.block_size)
  V.check_kv_tokens(spec, key, value, slot_mapping.shape[0])
  V.check_scales(spec, k_scale, v_scale)
  k_scale, v_scale = V.normalize_scale(k_scale), V.normalize_scale(v_scale)
  run = registry.WRITE.choose(impl, interpret, spec)
  rot = spec.codec.rotation
  key, value = rot.rotate(key), rot.rotate(value)
  stack = Stack.of(spec, cache, V.layer_index(layer))
  if stack is None:
    return run(cache, key, value, slot_mapping, spec, k_scale=k_scale, v_scale=v_scale)
  view, big = stack.write_view(cache, spec)           # free: B blocks of L * N tokens
  new = run(view, key, value, stack.write_slots(slot_mapping, spec.block_size), big,
            k_scale=k_scale, v_scale=v_scale)
  return new.reshape(cache.shape)


def read_kv(cache, spec: KVCacheSpec, slots, *, k_scale=None, v_scale=None, impl: str = "auto",
            interpret=None, layer=None):
  """Dequantized K and V of the given slots: two float32 ``[len(slots), H, D]`` arrays.

  slots: int ``[T]`` in ``[0, num_blocks * block_size)``: checked when concrete
  (ValueError); traced slots outside that range read as NaN rows.
  layer: with a layered cache (``spec.physical_shape(B, L)``), the layer read (a Python int
  or an int32 scalar; traced outside ``[0, L)``: NaN rows); slots are that layer's.
  ``impl`` / ``interpret`` pick the dequantize step from ``kvjax.registry.READ`` (as
  :func:`write_kv` does): the pages of the slots are gathered, dequantized, and each slot's
  row taken (and un-rotated, for a format that stores rotated rows).
  """
  num_blocks = V.check_cache(spec, cache, layer)
  num_slots = num_blocks * spec.block_size
  slots = V.check_slots(slots, num_slots, name="slots", negative_ok=False)
  V.check_scales(spec, k_scale, v_scale)
  k_scale, v_scale = V.normalize_scale(k_scale), V.normalize_scale(v_scale)
  run = registry.READ.choose(impl, interpret, spec)
  stack = Stack.of(spec, cache, V.layer_index(layer))
  valid = (slots >= 0) & (slots < num_slots) & (True if stack is None else stack.layer_ok())
  slots = jnp.where(valid, slots, 0)
  blocks = slots // spec.block_size
  pages = cache[blocks] if stack is None else stack.pages(cache, spec, blocks)
  k, v = run(pages, spec, k_scale=k_scale, v_scale=v_scale)    # [T, N, H, D]
  t = jnp.arange(slots.shape[0])
  off = slots % spec.block_size
  unrotate = spec.codec.rotation.unrotate
  nan_rows = lambda x: jnp.where(valid[:, None, None], unrotate(x[t, off]), jnp.nan)
  return nan_rows(k), nan_rows(v)
