"""Mosaic GPU (Hopper) cache write: K / V rows already in the cache's storage dtype, stored at
their slots, in place.

One CUDA block per token: it reads the token's slot; for a slot in ``[0, B * N)`` it copies
the token's K and V rows ``(H, D)`` into shared memory (two TMA loads) and from there into
the K and V halves of that slot's page row (two TMA stores); any other slot (negative:
padding) is skipped. The kernel moves bytes only: formats whose stored rows are the values
themselves (bf16 / f16; fp8 per tensor once quantized, which the caller does) share it.
Nothing outside the named slots' K / V boxes is written.

The cache is a ``jax.Ref`` argument of the kernel, so the call updates it in place (an
aliased input / output of the custom call): under ``jax.jit`` with the cache donated, XLA
writes the caller's buffer, and a launch from torch (:mod:`torch_bridge.mosaic_launch`)
writes the torch tensor's memory.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.mosaic_gpu.compat import interpret_params


@dataclasses.dataclass(frozen=True)
class WriteStatics:
  """num_slots: B * N; block_size: N; head_size: D; layout: "NHD" / "HND"; layer_axis: the
  layer dim of a layered (5-D) cache, whose layer is an int32 ``[1]`` operand (None: one
  layer's cache)."""
  num_slots: int
  block_size: int
  head_size: int
  layout: str
  interpret: bool = False
  layer_axis: Optional[int] = None


def _row_box(cache_ref, st: WriteStatics, blk, off, side, layer):
  """The ``(H, D)`` GMEM box of K (side 0) or V (side 1) of token ``off`` of page ``blk`` (of
  ``layer`` in a layered cache)."""
  cols = pl.ds(side * st.head_size, st.head_size)
  heads = slice(None)
  index = [blk, off, heads, cols] if st.layout == "NHD" else [blk, heads, off, cols]
  if st.layer_axis is not None:
    index.insert(st.layer_axis, layer)
  return cache_ref.at[tuple(index)]


def _kernel(slots_ref, k_ref, v_ref, cache_ref, *rest, st: WriteStatics):
  layer_ref, (k_smem, v_smem, bar) = (rest[0], rest[1:]) if st.layer_axis is not None else (
      None, rest)
  layer = None if layer_ref is None else layer_ref[0]
  t = lax.axis_index("token")
  slot = slots_ref[t]

  @pl.when((slot >= 0) & (slot < st.num_slots))
  def _store():
    plgpu.copy_gmem_to_smem(k_ref.at[t], k_smem, bar)
    plgpu.copy_gmem_to_smem(v_ref.at[t], v_smem, bar)
    plgpu.barrier_wait(bar)
    blk, off = lax.div(slot, st.block_size), lax.rem(slot, st.block_size)
    plgpu.copy_smem_to_gmem(k_smem, _row_box(cache_ref, st, blk, off, 0, layer))
    plgpu.copy_smem_to_gmem(v_smem, _row_box(cache_ref, st, blk, off, 1, layer))
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the grid's end makes the rows visible


def store_rows(slots, key_rows, value_rows, cache_ref, layer=None, *,
               st: WriteStatics) -> None:
  """Store the rows into ``cache_ref`` (a ``jax.Ref`` of the physical cache), in place.

  slots: int32 ``[T]``; key_rows, value_rows: ``[T, H, D]`` of the cache's storage dtype;
  layer: int32 ``[1]`` with ``st.layer_axis`` (a layered cache), else None.
  """
  _, h, d = key_rows.shape
  buf = plgpu.SMEM((h, d), key_rows.dtype)
  plgpu.kernel(
      lambda *refs: _kernel(*refs, st=st),
      out_type=(),
      grid=(key_rows.shape[0],),
      grid_names=("token",),
      scratch_types=(buf, buf, plgpu.Barrier(num_arrivals=2)),
      interpret=interpret_params() if st.interpret else None,
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
  )(slots, key_rows, value_rows, cache_ref, *(() if layer is None else (layer,)))


def write_rows(cache, key_rows, value_rows, slots, spec, *, interpret: bool = False,
               layer=None):
  """The cache with the rows stored at ``slots`` (a new array; donate ``cache`` under
  ``jax.jit`` to update it in place).

  cache: the spec's physical array (a format whose rows are stored as they are), one
  layer's, or layered with ``layer`` (an int or a traced int32 scalar) the layer written;
  key_rows, value_rows: ``[T, H, D]`` in the cache's storage dtype; slots: int32 ``[T]``.
  """
  if key_rows.dtype != cache.dtype or value_rows.dtype != cache.dtype:
    raise ValueError(f"rows {key_rows.dtype} / {value_rows.dtype} must have the cache's "
                     f"storage dtype {cache.dtype}")
  num_blocks, num_layers = spec.blocks_and_layers(cache)
  if (layer is None) != (num_layers is None):
    raise ValueError(f"layer={layer!r} with a cache of shape {tuple(cache.shape)}: pass layer "
                     "for a layered cache, and only then")
  st = WriteStatics(num_blocks * spec.block_size, spec.block_size, spec.head_size,
                    spec.layout, bool(interpret),
                    None if layer is None else spec.layer_axis)
  ref = jax.new_ref(cache)
  store_rows(jnp.asarray(slots, jnp.int32), key_rows, value_rows, ref,
             None if layer is None else jnp.asarray(layer, jnp.int32).reshape(1), st=st)
  return ref[...]
