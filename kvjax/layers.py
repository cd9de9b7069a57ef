"""Layered (cross-layer) caches: one array holding every layer, read and written in place.

vLLM's cross-layer allocation (``include_num_layers_dimension``) gives one array for L layers:
logical ``(L, B, H, N, C)``, stride order NHD ``(1, 0, 3, 2, 4)`` / HND ``(1, 2, 0, 3, 4)``, so the
physical array is NHD ``(B, L, N, H, C)`` / HND ``(B, H, L, N, C)``: blocks outermost, one block
spanning all layers (one transfer region for every layer, as KV connectors want). The ops take the
whole array and ``layer=`` (a Python int, or an int32 scalar that may be traced: one compiled
program serves every layer). Nothing is sliced or copied; the unchanged implementations see a free
(row-major) reshape of the physical array that is an ordinary one-layer cache:

- **Big blocks** (writes, every layout): ``(B, L*N, H, C)`` / ``(B, H, L*N, C)`` is a one-layer
  cache of B blocks of ``L*N`` tokens (the spec with ``block_size = L*N``) whose block b holds
  layer l's block b at tokens ``[l*N, (l+1)*N)``. Layer l's slot ``b*N + t`` is its slot
  ``(b*L + l)*N + t``.
- **Pages** (attention): ``(B*L, N, H, C)`` is a one-layer cache of ``B*L`` pages whose page
  ``b*L + l`` is layer l's block b; block ids map ``b -> clip(b, 0, B-1)*L + l`` (clamped
  first: rule 4 of :mod:`kvjax.ragged_batch`). In NHD the layer axis follows the block axis and
  this is a free reshape, which every implementation takes. An HND layer's page is H pieces
  ``L*N*C`` elements apart: the page view needs the layer axis moved next to the block axis, a
  transpose that XLA fuses into the page gathers of an XLA implementation (the reference) but
  that a kernel call would copy. So attention kernels refuse HND layered caches, and ``auto``
  passes them over to the reference.
- **Reads** (``read_kv``) gather each slot's page of the layer straight from the array.

A traced layer index outside ``[0, L)`` (the public ops reject a concrete one) writes nothing,
reads NaN rows, and attends over the nearest layer (clamped, like block ids): nothing outside
the array is read or written. nvfp4 caches have no layered form (their codec says why).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional, Union

import jax
import jax.numpy as jnp

from kvjax import ragged_batch as RB
from kvjax.spec import KVCacheSpec

Layer = Union[int, jax.Array]


@functools.lru_cache(maxsize=None)
def big_block_spec(spec: KVCacheSpec, num_layers: int) -> KVCacheSpec:
  """The spec of the big-block view: ``block_size = num_layers * spec.block_size``."""
  return dataclasses.replace(spec, block_size=spec.block_size * num_layers)


def pages_are_contiguous(spec: KVCacheSpec) -> bool:
  """Whether a layer's page of a layered array is contiguous (the layer axis follows the block
  axis), so that the array is an ordinary one-layer cache of ``B*L`` pages: NHD, not HND."""
  return spec.layer_axis == 1


def kernel_reason(spec: KVCacheSpec) -> Optional[str]:
  """Why an attention kernel (an opaque call that takes whole buffers) cannot read a layered
  cache of ``spec`` in place; None when it can."""
  if pages_are_contiguous(spec):
    return None
  return (f"a layer's page of a layered {spec.layout} cache is {spec.head_slots} strided pieces "
          "(the layer axis sits inside the page), which this kernel cannot address in place "
          "and would copy: use an NHD layered cache, one layer's 4-D cache, or impl='xla'")


def attention_condition(spec: KVCacheSpec):
  """The registry condition (``Registry.choose(..., also=...)``) of attention over a layered
  cache of ``spec``: None where every implementation reads it in place, else one that passes
  kernels over (XLA implementations read the layer's slice)."""
  why = kernel_reason(spec)
  if why is None:
    return None
  return lambda impl: None if impl.xla else why


@dataclasses.dataclass(frozen=True)
class Stack:
  """One layer of a validated layered cache.

  Attributes:
    num_blocks: B. num_layers: L.
    layer: the layer index, a Python int in ``[0, L)`` or an int32 scalar ``jax.Array``
      (possibly traced, then possibly outside ``[0, L)``).
  """
  num_blocks: int
  num_layers: int
  layer: Layer

  @classmethod
  def of(cls, spec: KVCacheSpec, cache, layer) -> Optional["Stack"]:
    """The stack of a cache already validated with its ``layer`` (None for a 4-D cache)."""
    if cache.ndim == 4:
      return None
    return cls(cache.shape[0], cache.shape[spec.layer_axis], layer)

  # -- the layer index -------------------------------------------------------------------------
  @property
  def static(self) -> bool:
    return isinstance(self.layer, int)

  def layer_ok(self):
    """True, or a traced bool: whether the layer index is in ``[0, L)``."""
    if self.static:
      return True
    return (self.layer >= 0) & (self.layer < self.num_layers)

  def clamped_layer(self):
    """The layer index clipped to ``[0, L)`` (int32 when traced)."""
    if self.static:
      return self.layer
    return jnp.clip(self.layer, 0, self.num_layers - 1).astype(jnp.int32)

  # -- writes: the big-block view --------------------------------------------------------------
  def write_view(self, cache, spec: KVCacheSpec):
    """(one-layer cache, its spec): the layered array as B blocks of ``L*N`` tokens (free)."""
    big = big_block_spec(spec, self.num_layers)
    return cache.reshape(big.physical_shape(self.num_blocks)), big

  def write_slots(self, slots, block_size: int):
    """Layer slots (int32 ``[T]``, as :func:`kvjax.slots.int32_slots` gives them) as slots of
    :meth:`write_view`: ``b*N + t -> (b*L + layer)*N + t``; slots outside ``[0, B*N)``, and all
    slots of a traced layer outside ``[0, L)``, become -1 (written nowhere)."""
    n = block_size
    valid = (slots >= 0) & (slots < self.num_blocks * n) & self.layer_ok()
    s = jnp.where(valid, slots, 0)
    mapped = (s // n * self.num_layers + self.clamped_layer()) * n + s % n
    return jnp.where(valid, mapped, -1).astype(jnp.int32)

  # -- attention -------------------------------------------------------------------------------
  def attention_operands(self, cache, spec: KVCacheSpec, block_table, xla: bool):
    """(one-layer cache, block table) that an attention implementation reads this layer with:
    :meth:`page_view` and block ids ``clip(b, 0, B-1)*L + layer`` (rule 4 of
    :mod:`kvjax.ragged_batch` first, so every mapped id names a page of this layer).

    ``xla``: the implementation is made of plain XLA ops; only those can take the page view of
    a layout whose pages are not contiguous (the registry passes kernels over there).
    """
    if not (xla or pages_are_contiguous(spec)):
      raise ValueError(kernel_reason(spec))
    blocks = RB.clamp_blocks(block_table, self.num_blocks) * self.num_layers
    return self.page_view(cache, spec), blocks + self.clamped_layer()

  def page_view(self, cache, spec: KVCacheSpec):
    """The layered array as ``B*L`` one-layer pages, page ``b*L + l`` = layer l's block b.

    Where pages are contiguous (NHD) a free reshape; otherwise the layer axis is moved next to
    the block axis first, a transpose that XLA fuses into the page gathers of an XLA
    implementation (never materialized under ``jit``) and that a kernel call would copy.
    """
    moved = jnp.moveaxis(cache, spec.layer_axis, 1)
    return moved.reshape((self.num_blocks * self.num_layers,) + spec.physical_shape(1)[1:])

  # -- reads -----------------------------------------------------------------------------------
  def pages(self, cache, spec: KVCacheSpec, blocks):
    """Layer pages ``[T, *spec.physical_shape(1)[1:]]`` of block ids ``blocks [T]`` (in range),
    gathered from the layered array."""
    index = [slice(None)] * cache.ndim
    index[0], index[spec.layer_axis] = blocks, self.clamped_layer()
    return cache[tuple(index)]
