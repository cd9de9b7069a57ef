"""Argument checks shared by the public ops: clear errors, raised before anything runs.

What each argument may be:
- ``cache``: a ``jax.Array`` (the spec's physical array). A numpy cache is refused: it
  would be copied to the device on every call and could never be written in place.
- ``key``, ``value``, ``q``: ``jax.Array`` or ``numpy.ndarray``.
- integer metadata (``slot_mapping``, ``slots``, ``query_start_loc``, ``seq_lens``,
  ``block_table``): ``jax.Array``, ``numpy.ndarray`` or a (nested) Python list/tuple of
  ints, everywhere alike.
- torch tensors are refused with a pointer to ``torch_bridge``.

Values are checked on the host when they are concrete (not traced under ``jit``): a
concrete ``jax.Array`` is read back once per call, numpy and lists cost nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.slots import int32_slots
from kvjax.spec import KVCacheSpec, MLACacheSpec

_I32 = np.iinfo(np.int32)
_ARRAYS = (jax.Array, np.ndarray)
_REAL_SCALARS = (int, float, np.integer, np.floating)


def is_concrete(x) -> bool:
  """True when ``x`` has values we can read now (not a tracer under jit).

  Read such values with numpy, never jnp: under ``jit`` a jnp op on a closed-over
  concrete array is traced.
  """
  return not isinstance(x, jax.core.Tracer)


def host_values(x):
  """``x`` as a numpy array when concrete, else None (traced under jit)."""
  return np.asarray(x) if is_concrete(x) else None


def _what(x) -> str:
  """How to name a wrong argument in a message: its type, and a hint for torch tensors."""
  name = type(x).__name__
  if type(x).__module__.split(".")[0] == "torch":
    return (f"torch.{name} (kvjax takes JAX arrays: import torch tensors with "
            "torch_bridge.from_torch or jax.dlpack.from_dlpack, or call "
            "torch_bridge.PagedAttentionBackend)")
  if isinstance(x, str):
    return f"str {x!r}"
  return name


def check_array(name: str, x, what: str = "array"):
  """``x`` must be a ``jax.Array`` or ``numpy.ndarray`` (TypeError naming ``name``)."""
  if not isinstance(x, _ARRAYS):
    raise TypeError(f"{name} must be a jax.Array or numpy.ndarray ({what}), got {_what(x)}")
  return x


def check_int_array(name: str, x, ndim: int):
  """An integer array of ``ndim`` dims: jax/numpy arrays as given, lists read as numpy."""
  if isinstance(x, (list, tuple)):
    if not all(is_concrete(leaf) for leaf in jax.tree_util.tree_leaves(x)):
      x = jnp.asarray(x)        # a list passed through jit: its leaves are traced
    else:
      try:
        arr = np.asarray(x)
      except ValueError as e:
        raise ValueError(f"{name} must be a rectangular list of ints: {e}") from None
      x = arr.astype(np.int32) if arr.size == 0 else arr
  elif not isinstance(x, _ARRAYS):
    raise TypeError(f"{name} must be an integer jax.Array, numpy array or list of ints, got "
                    f"{_what(x)}")
  if x.ndim != ndim:
    raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{name} must have an integer dtype, got {x.dtype}")
  return x


def saturate_int32(x):
  """``x`` as int32, values beyond int32's range clamped to its ends (never wrapped)."""
  dt = np.dtype(x.dtype)
  if dt == np.int32:
    return x
  xp = np if isinstance(x, np.ndarray) else jnp
  info = np.iinfo(dt)
  if info.max > _I32.max:
    x = xp.minimum(x, dt.type(_I32.max))
  if info.min < _I32.min:
    x = xp.maximum(x, dt.type(_I32.min))
  return x.astype(np.int32)


def as_jax_int32(x):
  """A checked integer array for the kernels: numpy (or list) values become an int32
  ``jax.Array`` (saturated, never wrapped); jax arrays and tracers pass unchanged."""
  return jnp.asarray(saturate_int32(x)) if isinstance(x, np.ndarray) else x


def check_cache(spec: KVCacheSpec, cache, layer=None) -> int:
  """``spec`` a KVCacheSpec and ``cache`` its physical ``jax.Array``; returns num_blocks.

  ``cache`` is one layer's 4-D array with ``layer`` None, or a layered (cross-layer) 5-D array
  with ``layer`` its layer index (:func:`check_layer`).
  """
  if not isinstance(spec, KVCacheSpec):
    mla = " (an MLACacheSpec latent cache is written and read with write_kv / read_kv only; " \
          "there is no MLA attention)" if isinstance(spec, MLACacheSpec) else ""
    raise TypeError(f"spec must be a KVCacheSpec, got {_what(spec)}{mla}")
  if not isinstance(cache, jax.Array):
    hint = " (wrap it once with jnp.asarray)" if isinstance(cache, np.ndarray) else ""
    raise TypeError(f"cache must be a jax.Array (the spec's physical array), got "
                    f"{_what(cache)}{hint}")
  if layer is None:
    return spec.num_blocks_of(cache)
  num_blocks, num_layers = spec.blocks_and_layers(cache)
  if num_layers is None:
    raise ValueError(f"layer={_layer_repr(layer)} was given, but cache of shape "
                     f"{tuple(cache.shape)} is one layer's 4-D cache: layer= goes with a "
                     "layered (cross-layer) 5-D cache only")
  check_layer(layer, num_layers)
  return num_blocks


def _layer_repr(layer) -> str:
  return repr(layer) if isinstance(layer, (int, np.integer)) else f"<{_what(layer)}>"


def check_layer(layer, num_layers: int):
  """A layer index: a Python / numpy int, or an integer scalar array (traced under jit is
  fine); in ``[0, num_layers)`` when concrete."""
  if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer) + _ARRAYS):
    raise TypeError(f"layer must be an int or an integer scalar array, got {_what(layer)}")
  if isinstance(layer, _ARRAYS):
    if layer.shape != () or not jnp.issubdtype(layer.dtype, jnp.integer):
      raise TypeError(f"layer must be an integer scalar, got shape {tuple(layer.shape)} dtype "
                      f"{layer.dtype}")
  value = host_values(layer)
  if value is not None and not 0 <= int(value) < num_layers:
    raise ValueError(f"layer={int(value)} is outside [0, {num_layers}): the cache holds "
                     f"{num_layers} layers")


def layer_index(layer):
  """A checked layer index for the ops: Python ints stay ints (static), arrays become int32
  ``jax.Array`` scalars (saturated, never wrapped), None stays None."""
  if layer is None or isinstance(layer, int):
    return layer
  if isinstance(layer, np.integer):
    return int(layer)
  return jnp.asarray(saturate_int32(layer))


def check_kv_tokens(spec: KVCacheSpec, key, value, num_tokens: int):
  """key, value ``[T', H, D]`` in the spec's model dtype with ``T' >= num_tokens``."""
  want = (spec.num_kv_heads, spec.head_size)
  for name, x in (("key", key), ("value", value)):
    check_array(name, x, f"[T, {want[0]}, {want[1]}] of {spec.dtype}")
    if x.ndim != 3 or tuple(x.shape[1:]) != want:
      raise ValueError(f"{name} must have shape [T, {want[0]}, {want[1]}] (num_kv_heads, "
                       f"head_size), got {tuple(x.shape)}")
    if np.dtype(x.dtype) != spec.dtype:
      raise TypeError(f"{name} dtype {np.dtype(x.dtype)} is not the spec's dtype {spec.dtype}")
    if x.shape[0] < num_tokens:
      raise ValueError(f"{name} has {x.shape[0]} tokens, fewer than len(slot_mapping)="
                       f"{num_tokens}")


def check_slot_values(name: str, slots: np.ndarray, num_slots: int, negative_ok: bool):
  """Host check of slot numbers: each ``< num_slots`` (and ``>= 0`` unless ``negative_ok``)."""
  if not slots.size:
    return
  if slots.max() >= num_slots:
    i = int(np.argmax(slots))
    raise ValueError(f"{name}[{i}] = {slots[i]} is past the cache: slots must be < "
                     f"num_blocks * block_size = {num_slots}")
  if not negative_ok and slots.min() < 0:
    i = int(np.argmin(slots))
    raise ValueError(f"{name} must be non-negative (read_kv reads slots in [0, {num_slots})), "
                     f"got {name}[{i}] = {slots[i]}")


def check_slots(slot_mapping, num_slots: int, name: str = "slot_mapping",
                negative_ok: bool = True):
  """Integer ``[T]`` slots, checked when concrete, returned as int32 without wrapping.

  Negative = skip (when ``negative_ok``). Wider integers are narrowed *after* the check
  (:func:`kvjax.slots.int32_slots`), so -(2**32) + 5 stays a skip.
  """
  x = check_int_array(name, slot_mapping, 1)
  vals = host_values(x)
  if vals is not None:
    check_slot_values(name, vals, num_slots, negative_ok)
  return int32_slots(x, num_slots)


def _check_scale_type(name: str, s):
  """A global or softmax scale: a real number or a numeric array (lists read as numpy)."""
  if isinstance(s, (list, tuple)):
    s = np.asarray(s)
  if isinstance(s, bool) or not isinstance(s, _REAL_SCALARS + _ARRAYS):
    raise TypeError(f"{name} must be a float or a float array, got {_what(s)}")
  if np.dtype(s.dtype if hasattr(s, "dtype") else type(s)).kind not in "fiu":
    raise TypeError(f"{name} must be a float or a float array, got dtype "
                    f"{np.dtype(s.dtype)}")
  return s


def _bad_entry(name: str, values: np.ndarray, bad: np.ndarray) -> str:
  """``name = v`` for a scalar, ``name[i] = v`` for the first bad entry of an array."""
  if values.size == 1:
    return f"{name} = {values.reshape(()).item()}"
  i = int(np.flatnonzero(bad.reshape(-1))[0])
  return f"{name}[{i}] = {values.reshape(-1)[i]}"


def check_scales(spec: KVCacheSpec, k_scale, v_scale):
  """Global scales: finite positive scalars (or [H] for fp8 per-tensor).

  Formats without global scales (plain, per-token-head) ignore them, as vLLM passes
  its default 1.0 to every backend; only their type is checked there.
  """
  fmt = spec.format
  for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
    if s is None:
      continue
    s = _check_scale_type(name, s)
    if not fmt.has_tensor_scales:
      continue
    shape = tuple(np.shape(s))
    allowed = list(spec.codec.scale_shape(spec.num_kv_heads))
    if shape not in allowed and shape != (1,):
      raise ValueError(f"{name} must be a scalar{' or shape [H]' if len(allowed) > 1 else ''} "
                       f"for cache_dtype={spec.cache_dtype!r}, got shape {shape}")
    vals = host_values(s)
    if vals is not None:
      bad = ~(np.isfinite(vals) & (vals > 0))
      if bad.any():
        raise ValueError(f"{name} must be finite and positive, got {_bad_entry(name, vals, bad)}")


def normalize_scale(s):
  if s is None:
    return None
  s = jnp.asarray(s, jnp.float32)
  return s.reshape(()) if s.shape == (1,) else s


def check_softmax_scale(scale):
  """The softmax scale: a finite real number (checked when concrete)."""
  scale = _check_scale_type("scale", scale)
  vals = host_values(scale)
  if vals is not None:
    if vals.shape != ():
      raise ValueError(f"scale must be a scalar, got shape {vals.shape}")
    if not np.isfinite(vals):
      raise ValueError(f"scale must be finite, got scale = {vals.item()}")


FP8_QUERY_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)


def query_input(q, q_scale, scale):
  """(the query the implementations read, its softmax scale) for a q of any accepted dtype.

  An fp8 query (float8_e4m3fn or float8_e5m2) carries ``q_scale`` (q's real value is
  ``q * q_scale``): it is widened to bfloat16, which holds every fp8 value exactly, and
  ``q_scale`` is folded into the softmax scale (``scale * q_scale``): q's values are not
  rounded, only the product of the two scales is.
  """
  is_fp8 = any(q.dtype == np.dtype(t) for t in FP8_QUERY_DTYPES)
  if q_scale is None:
    if is_fp8:
      raise ValueError(f"q of dtype {q.dtype} needs q_scale (its dequantization scale)")
    return q, scale
  if not is_fp8:
    raise ValueError(f"q_scale is for an fp8 q (float8_e4m3fn or float8_e5m2); q is {q.dtype}")
  q_scale = _check_scale_type("q_scale", q_scale)
  if jnp.shape(q_scale) != ():
    raise ValueError(f"q_scale must be a scalar, got shape {jnp.shape(q_scale)}")
  vals = host_values(q_scale)
  if vals is not None and not (np.isfinite(vals) and vals > 0):
    raise ValueError(f"q_scale must be a finite positive scalar, got {q_scale!r}")
  return q.astype(jnp.bfloat16), scale * q_scale


def check_soft_cap(soft_cap):
  """The logit soft cap: None or a finite positive number (checked when concrete)."""
  if soft_cap is None:
    return
  cap = host_values(_check_scale_type("soft_cap", soft_cap))
  if cap is not None and not (cap.shape == () and np.isfinite(cap) and cap > 0):
    raise ValueError(f"soft_cap must be a finite positive number or None, got {soft_cap!r}")


def check_impl(impl: str):
  if impl not in ("auto", "pallas", "reference"):
    raise ValueError(f"impl={impl!r} must be 'auto', 'pallas' or 'reference'")


def check_attention_inputs(q, cache, spec: KVCacheSpec, seq_lens, block_table, sliding_window,
                           soft_cap, sinks, layer=None):
  """Checks shared by every attention entry: q ``[T, Hq, D]``, the cache (and its ``layer``),
  seq_lens ``[S]``, block_table ``[S, M]``, and the static options. Returns (seq_lens,
  block_table) as arrays."""
  check_cache(spec, cache, layer)
  check_array("q", q, "[T, Hq, D] floating point")
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
  check_soft_cap(soft_cap)
  if sinks is not None and tuple(jnp.shape(sinks)) != (hq,):
    raise ValueError(f"sinks must have shape [{hq}] (one per query head), got {jnp.shape(sinks)}")
  return sl, bt


def check_attention_metadata(query_start_loc: np.ndarray, seq_lens: np.ndarray,
                             block_table: np.ndarray, *, num_tokens: int, num_blocks: int,
                             block_size: int, max_query_len=None):
  """Host check of concrete attention metadata (numpy ``[S+1]``, ``[S]``, ``[S, M]``).

  query_start_loc starts at 0, never decreases and ends at most at ``num_tokens``;
  each sequence's KV length is at least its query length and fits its block-table
  row; ``max_query_len`` bounds every query length; every block id a sequence uses
  (its first ``cdiv(seq_len, block_size)`` entries) is in ``[0, num_blocks)``.
  """
  qsl, sl, bt = query_start_loc, seq_lens, block_table
  num_seqs = sl.shape[0]
  if qsl[0] != 0:
    raise ValueError(f"query_start_loc must start at 0, got query_start_loc[0] = {qsl[0]}")
  q_lens = np.diff(qsl)
  if (q_lens < 0).any():
    i = int(np.flatnonzero(q_lens < 0)[0])
    raise ValueError(f"query_start_loc must not decrease, got query_start_loc[{i}] = {qsl[i]} > "
                     f"query_start_loc[{i + 1}] = {qsl[i + 1]}")
  if qsl[-1] > num_tokens:
    raise ValueError(f"query_start_loc[{num_seqs}] = {qsl[-1]} is past the {num_tokens} query "
                     "tokens of q")
  if not num_seqs:
    return
  if (sl < 0).any():
    i = int(np.flatnonzero(sl < 0)[0])
    raise ValueError(f"seq_lens must be non-negative, got seq_lens[{i}] = {sl[i]}")
  if (sl < q_lens).any():
    i = int(np.flatnonzero(sl < q_lens)[0])
    raise ValueError(f"seq_lens[{i}] = {sl[i]} is shorter than sequence {i}'s {q_lens[i]} query "
                     "tokens (seq_lens counts the cached prefix plus the new tokens)")
  cap = bt.shape[1] * block_size
  if (sl > cap).any():
    i = int(np.flatnonzero(sl > cap)[0])
    raise ValueError(f"seq_lens[{i}] = {sl[i]} exceeds the block_table capacity of "
                     f"{bt.shape[1]} blocks x {block_size} = {cap} tokens")
  if max_query_len is not None and q_lens.max() > max_query_len:
    i = int(np.argmax(q_lens))
    raise ValueError(f"sequence {i} has {q_lens[i]} query tokens > max_query_len={max_query_len}")
  used = np.arange(bt.shape[1])[None, :] < -(-sl.astype(np.int64) // block_size)[:, None]
  bad = used & ((bt < 0) | (bt >= num_blocks))
  if bad.any():
    s, j = (int(v) for v in np.argwhere(bad)[0])
    raise ValueError(f"block_table[{s}, {j}] = {bt[s, j]} is not a block id in "
                     f"[0, num_blocks={num_blocks}) (sequence {s} reads its first "
                     f"{-(-int(sl[s]) // block_size)} entries for seq_lens[{s}] = {sl[s]})")
