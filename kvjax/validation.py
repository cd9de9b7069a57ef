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


def check_attention_inputs(q, cache, spec: KVCacheSpec, seq_lens, block_table, sliding_window,
                           soft_cap, sinks):
  """Checks shared by every attention entry: q ``[T, Hq, D]``, the cache, seq_lens ``[S]``,
  block_table ``[S, M]``, and the static options."""
  if not isinstance(spec, KVCacheSpec):
    raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
  spec.num_blocks_of(cache)
  if q.ndim != 3:
    raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
  _, hq, d = q.shape
  if d != spec.head_size:
    raise ValueError(f"q head size {d} is not the spec's head_size {spec.head_size}")
  if hq % spec.num_kv_heads:
    raise ValueError(f"q has {hq} heads, not a multiple of num_kv_heads={spec.num_kv_heads}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"q must be floating point, got {q.dtype}")
  sl = check_int_array("seq_lens", seq_lens, 1)
  bt = check_int_array("block_table", block_table, 2)
  if bt.shape[0] != sl.shape[0]:
    raise ValueError(f"seq_lens [S] and block_table [S, M] disagree on S: {sl.shape}, {bt.shape}")
  if bt.shape[1] < 1:
    raise ValueError("block_table needs at least one column")
  if sliding_window is not None and (isinstance(sliding_window, bool) or
                                     not isinstance(sliding_window, (int, np.integer)) or
                                     sliding_window <= 0):
    raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
  if soft_cap is not None and not float(soft_cap) > 0:
    raise ValueError(f"soft_cap must be positive or None, got {soft_cap!r}")
  if sinks is not None and tuple(jnp.shape(sinks)) != (hq,):
    raise ValueError(f"sinks must have shape [{hq}] (one per query head), got {jnp.shape(sinks)}")
  return sl, bt
