"""Argument checks shared by the public ops: clear errors, raised before anything runs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import formats as F
from kvjax.spec import KVCacheSpec


def is_concrete(x) -> bool:
  """True when ``x`` has values we can read now (not a tracer under jit).

  Read such values with numpy, never jnp: under ``jit`` a jnp op on a closed-over
  concrete array is traced.
  """
  return not isinstance(x, jax.core.Tracer)


def check_int_array(name, x, ndim):
  x = jnp.asarray(x) if not hasattr(x, "dtype") else x
  if x.ndim != ndim:
    raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
  return x


def check_kv_tokens(spec: KVCacheSpec, key, value, num_tokens: int):
  """key, value ``[T', H, D]`` in the spec's model dtype with ``T' >= num_tokens``."""
  want = (spec.num_kv_heads, spec.head_size)
  for name, x in (("key", key), ("value", value)):
    if x.ndim != 3 or tuple(x.shape[1:]) != want:
      raise ValueError(f"{name} must have shape [T, {want[0]}, {want[1]}] (num_kv_heads, "
                       f"head_size), got {tuple(x.shape)}")
    if np.dtype(x.dtype) != spec.dtype:
      raise TypeError(f"{name} dtype {np.dtype(x.dtype)} is not the spec's dtype {spec.dtype}")
    if x.shape[0] < num_tokens:
      raise ValueError(f"{name} has {x.shape[0]} tokens, fewer than len(slot_mapping)="
                       f"{num_tokens}")


def check_slots(slot_mapping, num_slots: int):
  """slot_mapping: int ``[T]``; every non-negative slot < num_slots (checked when concrete)."""
  slot_mapping = check_int_array("slot_mapping", slot_mapping, 1)
  if is_concrete(slot_mapping) and slot_mapping.size:
    hi = int(np.max(np.asarray(slot_mapping)))
    if hi >= num_slots:
      raise ValueError(f"slot_mapping holds slot {hi} >= num_blocks * block_size = {num_slots}")
  return slot_mapping


def check_scales(spec: KVCacheSpec, k_scale, v_scale):
  """Global scales: scalars (or [H] for fp8 per-tensor), only for formats that use them."""
  fmt = spec.format
  for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
    if s is None:
      continue
    shape = tuple(jnp.shape(s))
    if not fmt.has_tensor_scales:
      continue  # accepted and ignored, as vLLM passes them to every backend
    allowed = [()] + ([(spec.num_kv_heads,)] if fmt.kind == F.FP8_PER_TENSOR else [])
    if shape not in allowed and shape != (1,):
      raise ValueError(f"{name} must be a scalar{' or shape [H]' if len(allowed) > 1 else ''} "
                       f"for cache_dtype={spec.cache_dtype!r}, got shape {shape}")
    if is_concrete(s) and not bool(np.all(np.asarray(s) > 0)):
      raise ValueError(f"{name} must be positive")


def normalize_scale(s):
  if s is None:
    return None
  s = jnp.asarray(s, jnp.float32)
  return s.reshape(()) if s.shape == (1,) else s


def check_impl(impl: str):
  if impl not in ("auto", "pallas", "reference"):
    raise ValueError(f"impl={impl!r} must be 'auto', 'pallas' or 'reference'")
