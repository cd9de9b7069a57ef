"""MLA latent caches (:class:`kvjax.MLACacheSpec`): what ``kvjax.write_kv`` and
``kvjax.read_kv`` do with one. The cache is ``(B, N, D_latent)`` in the model dtype, one
``[kv_c | k_pe]`` row per token, as vLLM's ``concat_and_cache_mla`` writes it; the pure-jnp
scatter writes it, moving bits (never floats)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import quant
from kvjax import validation as V
from kvjax.reference.cache_update import split_slots
from kvjax.spec import MLACacheSpec


def _check_mla(spec: MLACacheSpec, cache, impl, layer, op: str) -> int:
  """The latent cache ``(B, N, D_latent)`` of ``spec.dtype``; returns B."""
  if impl not in ("auto", "reference"):
    raise ValueError(f"impl={impl!r}: an MLA latent cache is {op} by the pure-jnp reference "
                     "only (impl='auto' or 'reference'); the Pallas kernels take KVCacheSpec "
                     "caches")
  if layer is not None:
    raise ValueError("layer= was given, but an MLA latent cache has no layered form: pass one "
                     "layer's (B, N, D_latent) array")
  if not isinstance(cache, jax.Array):
    hint = " (wrap it once with jnp.asarray)" if isinstance(cache, np.ndarray) else ""
    raise TypeError(f"cache must be a jax.Array (the spec's (B, N, D_latent) array), got "
                    f"{type(cache).__name__}{hint}")
  want = (spec.block_size, spec.latent_dim)
  if cache.ndim != 3 or tuple(cache.shape[1:]) != want or cache.shape[0] < 1:
    raise ValueError(f"cache of shape {tuple(cache.shape)} is not {spec}'s latent cache "
                     f"(B, {want[0]}, {want[1]})")
  if np.dtype(cache.dtype) != spec.dtype:
    raise TypeError(f"cache dtype {np.dtype(cache.dtype)} is not the spec's dtype {spec.dtype}")
  return cache.shape[0]


def write_mla(cache, kv_c, k_pe, slot_mapping, spec: MLACacheSpec, impl, layer):
  """:func:`write_kv` for an MLA latent cache: rows ``[kv_c | k_pe]`` scattered by slot."""
  num_blocks = _check_mla(spec, cache, impl, layer, "written")
  slots = V.check_slots(slot_mapping, num_blocks * spec.block_size)
  parts = [("key", kv_c)] + ([] if k_pe is None else [("value", k_pe)])
  for name, x in parts:
    V.check_array(name, x, f"[T, D] of {spec.dtype}")
    if x.ndim != 2:
      raise ValueError(f"{name} must be 2-D [T, D] for an MLA latent cache, got shape "
                       f"{tuple(x.shape)}")
    if np.dtype(x.dtype) != spec.dtype:
      raise TypeError(f"{name} dtype {np.dtype(x.dtype)} is not the spec's dtype {spec.dtype}")
    if x.shape[0] < slots.shape[0]:
      raise ValueError(f"{name} has {x.shape[0]} tokens, fewer than len(slot_mapping)="
                       f"{slots.shape[0]}")
  width = sum(x.shape[1] for _, x in parts)
  if width != spec.latent_dim:
    got = " + ".join(str(x.shape[1]) for _, x in parts)
    raise ValueError(f"key (kv_c) and value (k_pe) widths {got} = {width} must add up to the "
                     f"spec's latent_dim {spec.latent_dim}")
  t = slots.shape[0]
  rows = jnp.concatenate([jnp.asarray(x[:t]) for _, x in parts], axis=-1)
  block, off = split_slots(slots, spec, num_blocks)       # slots outside the cache: block B
  bits = quant.to_bits(cache).at[block, off].set(quant.to_bits(rows), mode="drop")
  return quant.from_bits(bits, cache.dtype)


def read_mla(cache, spec: MLACacheSpec, slots, impl, layer):
  """:func:`read_kv` for an MLA latent cache: float32 ``[T, D_latent]``."""
  num_blocks = _check_mla(spec, cache, impl, layer, "read")
  num_slots = num_blocks * spec.block_size
  slots = V.check_slots(slots, num_slots, name="slots", negative_ok=False)
  valid = (slots >= 0) & (slots < num_slots)
  slots = jnp.where(valid, slots, 0)
  rows = cache[slots // spec.block_size, slots % spec.block_size].astype(jnp.float32)
  return jnp.where(valid[:, None], rows, jnp.nan)
