"""Recognize a torch cache tensor: vLLM's logical view or the physical contiguous tensor.

A cache of spec ``s`` with B blocks is one contiguous buffer of shape
``s.physical_shape(B)``; vLLM hands around its logical view
``physical.permute(inverse stride order)``, shape ``s.logical_shape(B)``. With a
leading layers dim (cross-layer allocation) both are 5-D. Anything else (a K half,
one head, a strided slice) is refused: it cannot be shared as one buffer.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from kvjax.spec import KVCacheSpec, contiguous_strides
from torch_bridge import dtypes

#: CPU buffers JAX imports without a copy start at a multiple of this many bytes.
CPU_ALIGNMENT = 64


def _check_tensor(tensor):
  if not isinstance(tensor, torch.Tensor):
    raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
  if tensor.layout != torch.strided:
    raise TypeError(f"cache tensor must be strided (dense), got layout {tensor.layout}")
  if tensor.ndim not in (4, 5):
    raise ValueError(f"cache tensor must be 4-D (or 5-D with a layers dim), got shape "
                     f"{tuple(tensor.shape)}")


def _strides_match(tensor, shape, strides) -> bool:
  """Equal shape and equal strides on every dim of size > 1 (size-1 strides are free)."""
  if tuple(tensor.shape) != tuple(shape):
    return False
  return all(n == 1 or a == b for n, a, b in zip(shape, tensor.stride(), strides))


def _inverse(order):
  return tuple(order.index(i) for i in range(len(order)))


def _blocks_layers(shape, from_logical: bool, order) -> Tuple[int, Optional[int]]:
  """(B, L) read from a tensor shape taken as logical or as physical."""
  if len(shape) == 4:
    return shape[0], None
  logical = shape if from_logical else tuple(shape[_inverse(order)[i]] for i in range(5))
  return logical[1], logical[0]


def _expected(spec: KVCacheSpec, b: int, layers: Optional[int]):
  try:
    return spec.logical_shape(b, layers), spec.physical_shape(b, layers)
  except ValueError:
    return None, None


VIEWS = ("logical", "physical")


def physical_tensor(tensor, spec: KVCacheSpec, view: Optional[str] = None) -> torch.Tensor:
  """The contiguous physical tensor behind ``tensor`` (a view, never a copy).

  Accepts vLLM's logical view (shape ``spec.logical_shape(B)``, strides of the
  permuted physical buffer) or the physical contiguous tensor itself; dtype must be
  the spec's storage dtype (uint8 also for fp8 per-tensor caches).
  ``view``: None (tell from shape and strides), "logical" or "physical" (accept only
  that one). Where shape and strides cannot tell them apart (an NHD cache with
  ``num_kv_heads == block_size``: a contiguous tensor of the logical shape may be the
  physical buffer or a contiguous copy of the logical view), None refuses.
  Raises TypeError for a wrong dtype / non-tensor and ValueError for any shape or
  stride pattern that is not one whole compact cache.
  """
  _check_tensor(tensor)
  if view is not None and view not in VIEWS:
    raise ValueError(f"view={view!r} must be None, 'logical' or 'physical'")
  if tensor.dtype not in dtypes.accepted_cache_dtypes(spec):
    raise TypeError(f"cache tensor dtype {tensor.dtype} is not one of "
                    f"{dtypes.accepted_cache_dtypes(spec)} for cache_dtype={spec.cache_dtype!r}")
  with_layers = tensor.ndim == 5
  order = spec.stride_order(with_layers)
  b, layers = _blocks_layers(tuple(tensor.shape), True, order)
  logical_shape, _ = _expected(spec, b, layers)
  if view != "physical" and logical_shape is not None and _strides_match(
      tensor, logical_shape, spec.logical_strides(b, layers)):
    return tensor.permute(order)
  b, layers = _blocks_layers(tuple(tensor.shape), False, order)
  logical_shape, physical_shape = _expected(spec, b, layers)
  if view != "logical" and physical_shape is not None and _strides_match(
      tensor, physical_shape, contiguous_strides(physical_shape)):
    if view is None and physical_shape == logical_shape and order != tuple(range(len(order))):
      raise ValueError(
          f"contiguous tensor of shape {tuple(tensor.shape)} is ambiguous: this {spec.layout} "
          f"cache's logical and physical shapes are equal (num_kv_heads={spec.num_kv_heads}, "
          f"block_size={spec.block_size}), so it may be the physical buffer or a contiguous "
          "copy of vLLM's logical view, with heads and tokens swapped. Pass the logical view "
          "(as allocate_kv_cache and to_torch return it), or say view='physical' if it is the "
          "physical buffer")
    return tensor
  if tensor.ndim == 4:
    _refuse_layer_slice(tensor, spec)
  wanted = {None: "neither the logical view nor the physical contiguous buffer",
            "logical": "not the logical view (view='logical')",
            "physical": "not the physical contiguous buffer (view='physical')"}[view]
  raise ValueError(
      f"tensor of shape {tuple(tensor.shape)} strides {tensor.stride()} is {wanted} of a "
      f"{spec.layout} {spec.cache_dtype!r} cache (for B={b}: logical {logical_shape}, physical "
      f"{physical_shape}); non-compact views (a K half, one head, a strided slice) cannot be "
      "shared as one buffer")


def _refuse_layer_slice(tensor, spec: KVCacheSpec):
  """ValueError if the 4-D ``tensor`` is laid out like one layer of a layered (cross-layer)
  cache: ``kv[l]`` of its logical view or the layer's slice of its physical buffer (not
  compact: its blocks sit ``L`` pages apart). The ops take the whole layered tensor and
  ``layer=`` instead. (Every L-th block of a one-layer cache looks the same: the message
  says both.)"""
  page = math.prod(spec.physical_shape(1)[1:])
  b, layers = tensor.shape[0], tensor.stride(0) // page
  if b < 2 or layers < 2 or tensor.stride(0) % page:
    return
  try:
    logical = spec.logical_strides(b, layers)
    physical = contiguous_strides(spec.physical_shape(b, layers))
  except ValueError:
    return
  axis = spec.layer_axis
  phys_shape = spec.physical_shape(b, layers)
  forms = ((spec.logical_shape(b), logical[1:], logical[0], "kv[l] of its logical view"),
           (phys_shape[:axis] + phys_shape[axis + 1:], physical[:axis] + physical[axis + 1:],
            physical[axis], "the layer's slice of its physical buffer"))
  for shape, strides, layer_stride, what in forms:
    if _strides_match(tensor, shape, strides):
      guess = tensor.storage_offset() // layer_stride
      like = f"layer {guess}" if 0 <= guess < layers else "one layer"
      raise ValueError(
          f"tensor of shape {tuple(tensor.shape)} strides {tensor.stride()} is a non-compact "
          f"view, its blocks {layers} pages apart: it is laid out like {like} of a layered "
          f"(cross-layer) cache of {layers} layers ({what}). A layer cannot be shared as one "
          "buffer: pass the whole layered tensor and the layer index (layer=) instead")


def refuse_part_of_storage(tensor: torch.Tensor, name: str = "kv_cache"):
  """ValueError if a 4-D cache tensor covers at most half of its storage.

  A cache is its own allocation (``allocate_kv_cache`` / ``empty_cache``; vLLM allocates one
  buffer per cache). A compact tensor inside a bigger buffer is most likely one block of a
  layered cache (``kv[:, b]`` of the logical view, ``physical[b]``: every layer of block b,
  whose shape and strides are those of a one-layer cache of L blocks): refused, with the fix.
  """
  need = tensor.numel() * tensor.element_size()
  have = tensor.untyped_storage().nbytes()
  if tensor.ndim == 4 and need and have >= 2 * need:
    raise ValueError(
        f"{name} of shape {tuple(tensor.shape)} covers {need} of its storage's {have} bytes: it "
        "is a slice of a bigger buffer, e.g. one block of a layered (cross-layer) cache "
        "(kv[:, b] of its logical view), not a cache. Pass a whole cache: for a layered one, "
        "the whole layered tensor and the layer index (layer=)")


def logical_view(tensor, spec: KVCacheSpec, view: Optional[str] = None) -> torch.Tensor:
  """vLLM's logical view ``(B, H, N, C)`` (or ``(L, B, H, N, C)``) of a cache tensor.

  ``view`` as in :func:`physical_tensor`.
  """
  phys = physical_tensor(tensor, spec, view)
  return phys.permute(_inverse(spec.stride_order(phys.ndim == 5)))


def check_shareable(phys: torch.Tensor):
  """Refuse a physical tensor JAX could only import by copying (CPU pointer alignment)."""
  if phys.device.type == "cpu" and phys.data_ptr() % CPU_ALIGNMENT:
    raise ValueError(
        f"CPU cache tensor starts at address {phys.data_ptr():#x}, not a multiple of "
        f"{CPU_ALIGNMENT} bytes: JAX would silently copy it. Allocate it with "
        "PagedAttentionBackend.allocate_kv_cache or torch_bridge.empty_cache")
  if phys.device.type not in ("cpu", "cuda"):
    raise ValueError(f"tensor on device {phys.device} cannot be shared with JAX (cpu or cuda)")
