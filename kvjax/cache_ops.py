"""Public cache writes and reads: ``write_kv`` and ``read_kv`` (docs/layout.md §4, §5).

Both take a :class:`kvjax.KVCacheSpec` (the packed K/V cache, every cache dtype) or a
:class:`kvjax.MLACacheSpec` (MLA's latent cache ``(B, N, D_latent)`` in the model dtype, written
as vLLM's ``concat_and_cache_mla`` writes it: one ``[kv_c | k_pe]`` row per token).
"""
from __future__ import annotations

import jax.numpy as jnp

from kvjax import mla_cache
from kvjax import registry
from kvjax import validation as V
from kvjax.layers import Stack
from kvjax.spec import KVCacheSpec, MLACacheSpec


def write_kv(cache, key, value, slot_mapping, spec: KVCacheSpec, *, k_scale=None, v_scale=None,
             impl: str = "auto", interpret=None, layer=None):
  """Write new tokens' K/V into the cache by slot mapping; returns the new cache.

  Args:
    cache: the spec's physical array (``spec.physical_shape(B)``, ``spec.storage_dtype``), or
      a layered one (``spec.physical_shape(B, L)``) with ``layer``.
    key, value: ``[T', H, D]`` in ``spec.dtype``; only the first ``len(slot_mapping)``
      tokens are written (T' >= T: a padded step's extra rows are ignored).
    slot_mapping: int ``[T]`` (jax or numpy array, or a list): token ``i`` goes to page
      ``slot_mapping[i] // block_size``, offset ``slot_mapping[i] % block_size``; a negative
      slot skips the token. Slots past the cache raise a ValueError when concrete and are
      dropped (never wrapped) when traced.
    spec: the :class:`kvjax.KVCacheSpec` of ``cache``.
    k_scale, v_scale: global scales (fp8 per-tensor: scalar or [H]; nvfp4: scalar), float32;
      None = 1.0. Formats without global scales ignore them.
    impl: "auto" or a name in ``kvjax.registry.WRITE`` ("pallas" = the Triton kernel,
      "mosaic_tpu", "reference"); interpret: Pallas interpret mode (None: where the kernel is
      not native). ``kvjax.explain("write", spec)`` says which implementation runs and why.
    layer: with a layered cache, the layer written: a Python int or an int32 scalar (traced
      under jit: one program for every layer; outside ``[0, L)`` it writes nothing). Slots
      are the layer's own (``block * block_size + offset``); only that layer's rows change
      (:mod:`kvjax.layers`).
  Returns:
    the new cache, same shape and dtype.

  Pure: under ``jax.jit`` with the cache donated, the write happens in place.
  Quantize-on-write for every cache dtype; rows not named by a slot keep their bytes. A format
  that stores rotated rows (int4 per token-head: ``spec.codec.rotation``) gets key and value
  rotated here, before any implementation encodes them.

  With an :class:`kvjax.MLACacheSpec` (MLA's latent cache, vLLM's ``concat_and_cache_mla``):
  ``cache`` is ``(B, N, D_latent)`` in ``spec.dtype``, ``key`` is ``kv_c`` ``[T', D_c]`` and
  ``value`` is ``k_pe`` ``[T', D_latent - D_c]`` (both ``spec.dtype``; each token's row is
  stored as ``[kv_c | k_pe]``), or ``value=None`` and ``key`` the whole latent rows
  ``[T', D_latent]``. The slot rules are the same; the rows are stored as given (no scales:
  ``k_scale`` / ``v_scale`` are ignored), by the pure-jnp scatter (``impl`` "auto" or
  "reference"); there is no layered MLA cache.

  >>> import jax, jax.numpy as jnp, kvjax
  >>> spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16,
  ...                          cache_dtype="int8_per_token_head")
  >>> cache = spec.allocate(num_blocks=4)
  >>> cache.shape, cache.dtype          # NHD (B, N, H, 2 * (D + 4)): a float32 scale per side
  ((4, 16, 2, 136), dtype('int8'))
  >>> k = jnp.linspace(-1, 1, 3 * 2 * 64).reshape(3, 2, 64).astype(jnp.bfloat16)
  >>> cache = kvjax.write_kv(cache, k, -k, [17, 18, -1], spec)   # page 1, offsets 1, 2; a skip
  >>> write = jax.jit(kvjax.write_kv, donate_argnums=0)          # in place; spec needs no static
  >>> cache = write(cache, k, -k, jnp.array([0, 63, -1]), spec)
  >>> k_back, v_back = kvjax.read_kv(cache, spec, [17, 63])
  >>> bool(jnp.abs(k_back - k[:2]).max() <= 0.5 / 127)     # half an int8 step (|k| <= 1)
  True

  An MLA latent cache (576 = 512 compressed dims + 64 rope dims, as DeepSeek's):

  >>> mla = kvjax.MLACacheSpec(latent_dim=576, block_size=16)
  >>> latent = mla.allocate(num_blocks=4)                     # (4, 16, 576) bfloat16
  >>> kv_c = jnp.ones((2, 512), jnp.bfloat16); k_pe = jnp.full((2, 64), 2, jnp.bfloat16)
  >>> latent = write(latent, kv_c, k_pe, jnp.array([5, 40]), mla)   # page 0 row 5, page 2 row 8
  >>> latent[2, 8, 510:514].tolist()
  [1.0, 1.0, 2.0, 2.0]
  """
  if isinstance(spec, MLACacheSpec):
    return mla_cache.write_mla(cache, key, value, slot_mapping, spec, impl, layer)
  num_blocks = V.check_cache(spec, cache, layer)
  slot_mapping = V.check_slots(slot_mapping, num_blocks * spec.block_size)
  V.check_kv_tokens(spec, key, value, slot_mapping.shape[0])
  V.check_scales(spec, k_scale, v_scale)
  k_scale, v_scale = V.normalize_scale(k_scale), V.normalize_scale(v_scale)
  routes = registry.WRITE.routes(impl, interpret, spec, array=cache)
  rot = spec.codec.rotation
  key, value = rot.rotate(key), rot.rotate(value)
  stack = Stack.of(spec, cache, V.layer_index(layer))

  def write(run):
    if stack is None:
      return run(cache, key, value, slot_mapping, spec, k_scale=k_scale, v_scale=v_scale)
    view, big = stack.write_view(cache, spec)           # free: B blocks of L * N tokens
    new = run(view, key, value, stack.write_slots(slot_mapping, spec.block_size), big,
              k_scale=k_scale, v_scale=v_scale)
    return new.reshape(cache.shape)
  return routes.run(write)


def read_kv(cache, spec: KVCacheSpec, slots, *, k_scale=None, v_scale=None, impl: str = "auto",
            interpret=None, layer=None):
  """Dequantized K and V of the given slots: two float32 ``[len(slots), H, D]`` arrays.

  Args:
    cache: the spec's physical array; spec: its :class:`kvjax.KVCacheSpec`.
    slots: int ``[T]`` in ``[0, num_blocks * block_size)`` (``page * block_size + offset``):
      checked when concrete (ValueError); traced slots outside that range read as NaN rows.
    k_scale, v_scale: the global scales the cache was written with (see :func:`write_kv`).
    impl, interpret: pick the dequantize step from ``kvjax.registry.READ`` (as
      :func:`write_kv` does): the pages of the slots are gathered, dequantized, and each
      slot's row taken (and un-rotated, for a format that stores rotated rows).
    layer: with a layered cache (``spec.physical_shape(B, L)``), the layer read (a Python
      int or an int32 scalar; traced outside ``[0, L)``: NaN rows); slots are that layer's.

  >>> import jax.numpy as jnp, kvjax
  >>> spec = kvjax.KVCacheSpec(num_kv_heads=1, head_size=16, block_size=16, dtype=jnp.float32)
  >>> k = jnp.arange(32.0).reshape(2, 1, 16)
  >>> cache = kvjax.write_kv(spec.allocate(2), k, k + 100, [5, 20], spec)
  >>> k_back, v_back = kvjax.read_kv(cache, spec, [20])
  >>> k_back.shape, k_back[0, 0, :3].tolist(), v_back[0, 0, :3].tolist()
  ((1, 1, 16), [16.0, 17.0, 18.0], [116.0, 117.0, 118.0])

  With an :class:`kvjax.MLACacheSpec` it returns *one* float32 ``[len(slots), D_latent]``
  array, the latent rows (``[kv_c | k_pe]``) of the slots; traced invalid slots read as NaN.

  >>> mla = kvjax.MLACacheSpec(latent_dim=32, block_size=16, dtype=jnp.float32)
  >>> latent = kvjax.write_kv(mla.allocate(2), jnp.arange(64.0).reshape(2, 32), None, [3, 17], mla)
  >>> rows = kvjax.read_kv(latent, mla, [17])
  >>> rows.shape, rows[0, :3].tolist()
  ((1, 32), [32.0, 33.0, 34.0])
  """
  if isinstance(spec, MLACacheSpec):
    return mla_cache.read_mla(cache, spec, slots, impl, layer)
  num_blocks = V.check_cache(spec, cache, layer)
  num_slots = num_blocks * spec.block_size
  slots = V.check_slots(slots, num_slots, name="slots", negative_ok=False)
  V.check_scales(spec, k_scale, v_scale)
  k_scale, v_scale = V.normalize_scale(k_scale), V.normalize_scale(v_scale)
  routes = registry.READ.routes(impl, interpret, spec, array=cache)
  stack = Stack.of(spec, cache, V.layer_index(layer))
  valid = (slots >= 0) & (slots < num_slots) & (True if stack is None else stack.layer_ok())
  slots = jnp.where(valid, slots, 0)
  blocks = slots // spec.block_size
  pages = cache[blocks] if stack is None else stack.pages(cache, spec, blocks)
  k, v = routes.run(lambda run: run(pages, spec, k_scale=k_scale, v_scale=v_scale))  # [T,N,H,D]
  t = jnp.arange(slots.shape[0])
  off = slots % spec.block_size
  unrotate = spec.codec.rotation.unrotate
  nan_rows = lambda x: jnp.where(valid[:, None, None], unrotate(x[t, off]), jnp.nan)
  return nan_rows(k), nan_rows(v)
