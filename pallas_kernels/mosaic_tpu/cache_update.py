"""Mosaic TPU cache write by slot mapping, quantize-on-write (docs/layout.md §4, §5).

Entry point :func:`write_kv` (inputs already validated by ``kvjax.write_kv``). It stores the
bytes of ``kvjax.reference.cache_update.write_kv`` and no others.

Plan. The grid walks the tokens ``TB`` at a time. Each step gets its tokens' K and V
``[TB, H, D]`` as pipelined VMEM blocks, encodes them into whole packed rows
``[TB, H, C]`` in a VMEM scratch (quantizing in the kernel), then copies each row to its
slot with a DMA straight into the cache, which stays in HBM (``memory_space=pl.ANY``) and
is aliased to the output (``input_output_aliases``: in place when the caller donates it).

- NHD: a slot's rows for all heads are one ``(H, C)`` slab, ``cache[block, offset]``:
  one DMA per token, whole minor dims (the pattern TPU DMAs move best).
- HND: a slot's row of head h is ``cache[block, h, offset]``, one ``(1, C)`` row per
  (token, head): H DMAs per token, each a single sublane row of an ``(N, C)`` tile.

Slots are scalar-prefetched into SMEM. A negative slot, or one past
``num_blocks * block_size``, starts no DMA, so no other cache byte is read or written.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kvjax import quant
from kvjax.spec import KVCacheSpec
from pallas_kernels.mosaic_tpu import tuning
from pallas_kernels.mosaic_tpu.adapters import rows_of, unsupported_reason
from pallas_kernels.mosaic_tpu.rows import Rows, halves_order
from pallas_kernels.mosaic_tpu.interpret import interpret_params

def supports_write(spec) -> str | None:
  """None when :func:`write_kv` handles ``spec``, else a one-line reason."""
  return unsupported_reason(spec)


def write_kv(cache, key, value, slot_mapping, spec: KVCacheSpec, *, k_scale=None, v_scale=None,
             interpret=False):
  """Scatter new tokens' K/V into the physical cache; returns the new cache.

  Args:
    cache: the spec's physical array, NHD ``(B, N, H, C)`` or HND ``(B, H, N, C)``.
    key, value: ``[T', H, D]`` in ``spec.dtype``, ``T' >= T``; only the first T are written.
    slot_mapping: int32 ``[T]``; a negative slot or one ``>= B * N`` writes nothing.
    k_scale, v_scale: fp8 per-tensor scales, None or float32 scalar / ``[H]``.
    interpret: True runs in TPU interpret mode (CPU), False compiles for a TPU; see
      :func:`pallas_kernels.mosaic_tpu.interpret.interpret_params`.
  """
  reason = supports_write(spec)
  if reason is not None:
    raise ValueError(f"mosaic_tpu write_kv: {reason}")
  t = slot_mapping.shape[0]
  if t == 0:
    return cache
  h, d = spec.num_kv_heads, spec.head_size
  tb = min(tuning.WRITE_TOKENS_PER_STEP, t)
  steps = pl.cdiv(t, tb)
  pad = steps * tb - t
  num_slots = cache.shape[0] * spec.block_size
  slots = slot_mapping.astype(jnp.int32)
  slots = jnp.where((slots >= 0) & (slots < num_slots), slots, -1)
  slots = jnp.pad(slots, (0, pad), constant_values=-1)
  key = jnp.pad(key[:t], ((0, pad), (0, 0), (0, 0)))
  value = jnp.pad(value[:t], ((0, pad), (0, 0), (0, 0)))

  codec = rows_of(spec)
  if codec.split_halves:
    order = halves_order(d)
    key, value = key[..., order], value[..., order]
  kv_block = pl.BlockSpec((tb, h, d), lambda i, slots_ref: (i, 0, 0))
  inputs, in_specs = [key, value], [kv_block, kv_block]
  if codec.tensor_scaled:
    # 1/scale exactly as kvjax.quant computes it, so the kernel's x * (1/scale) is the same.
    recips = [jnp.broadcast_to(1.0 / quant.per_head_scale(s, h), (h, 1)).astype(jnp.float32)
              for s in (k_scale, v_scale)]
    inputs.append(jnp.stack(recips))
    in_specs.append(pl.BlockSpec((2, h, 1), lambda i, slots_ref: (0, 0, 0)))
  inputs.append(cache)
  in_specs.append(pl.BlockSpec(memory_space=pl.ANY))
  kernel = functools.partial(_write_kernel, codec=codec, layout=spec.layout, tb=tb,
                             has_recips=codec.tensor_scaled)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1, grid=(steps,), in_specs=in_specs,
          out_specs=pl.BlockSpec(memory_space=pl.ANY),
          scratch_shapes=[pltpu.VMEM((tb, h, codec.width), spec.storage_dtype),
                          pltpu.SemaphoreType.DMA(())]),
      out_shape=jax.ShapeDtypeStruct(cache.shape, cache.dtype),
      input_output_aliases={len(inputs): 0},   # operand index counts the prefetched slots
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
      interpret=interpret_params(interpret),
      name="kvjax_mosaic_tpu_write_kv",
  )(slots, *inputs)


def _write_kernel(slots_ref, k_ref, v_ref, *rest, codec: Rows, layout: str, tb: int,
                  has_recips: bool):
  """One grid step: encode TB tokens' rows into ``rows_ref``, DMA each to its slot."""
  if has_recips:
    recip_ref, _, cache_hbm, rows_ref, sem = rest
  else:
    recip_ref = None
    _, cache_hbm, rows_ref, sem = rest
  d = codec.data_width
  for side, x_ref in enumerate((k_ref, v_ref)):
    recip = None if recip_ref is None else recip_ref[side]          # (H, 1)
    data, scale_bytes = codec.encode_side(x_ref[...], recip)
    start = codec.data_start(side)
    rows_ref[:, :, start:start + d] = data
    if scale_bytes is not None:
      rows_ref[:, :, start + d:start + d + 4] = scale_bytes

  n = cache_hbm.shape[2] if layout == "HND" else cache_hbm.shape[1]
  heads = rows_ref.shape[1]
  base = pl.program_id(0) * tb

  def copies(i, slot):
    """The DMAs that move token i's rows to ``slot``."""
    block, off = jax.lax.div(slot, n), jax.lax.rem(slot, n)    # slot >= 0 here
    if layout == "NHD":
      return [pltpu.make_async_copy(rows_ref.at[i], cache_hbm.at[block, off], sem)]
    return [pltpu.make_async_copy(rows_ref.at[i, pl.ds(hh, 1)],
                                  cache_hbm.at[block, hh, pl.ds(off, 1)], sem)
            for hh in range(heads)]

  for wait in (False, True):
    for i in range(tb):
      slot = slots_ref[base + i]

      @pl.when(slot >= 0)
      def _():
        for c in copies(i, slot):
          if wait:
            c.wait()
          else:
            c.start()
