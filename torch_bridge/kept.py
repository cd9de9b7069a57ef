"""What a :class:`torch_bridge.backend.PagedAttentionBackend` keeps between calls: the cache
tensors it has validated and imported, and the checks of a layer index against them."""
from __future__ import annotations

import ctypes

import numpy as np
import torch


#: Cache tensors a backend keeps validated and imported (one model's layers, whatever their
#: number, on one backend).
KEEP_CACHES = 512
#: Donated outputs kept for reuse (CUDA): at most this many, each at most this large
#: (a kept result holds its output tensor's memory).
KEEP_OUTPUTS, KEEP_OUTPUT_BYTES = 32, 1 << 20


class KeptCache:
  """A cache tensor the backend has validated: its storage-typed physical tensor, the
  storage bytes it addresses, (B, L) (L None for one layer), the JAX view (None until
  imported; after a donated write, the result), whether in-place writing was verified and
  (CPU, after a first write) its bytes as a numpy uint8 array over the same memory."""
  __slots__ = ("phys", "need", "num_blocks", "num_layers", "arr", "inplace_checked", "host")

  def __init__(self, phys, need, num_blocks, num_layers):
    self.phys, self.need, self.num_blocks, self.num_layers = phys, need, num_blocks, num_layers
    self.arr, self.inplace_checked, self.host = None, False, None


def host_bytes(phys: torch.Tensor) -> np.ndarray:
  """The bytes of a contiguous CPU tensor as a writable flat numpy uint8 array over the same
  memory. Built from the address, not ``Tensor.numpy()``, which would make the storage
  non-resizable for good (the storage check must keep seeing a resize as what it is)."""
  nbytes = phys.numel() * phys.element_size()
  return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(phys.data_ptr()))


def check_layer(layer, num_layers, kv_cache):
  """``layer`` pairs with the cache: None for one layer's cache, else an int in [0, L)."""
  shape = tuple(kv_cache.shape)
  if num_layers is None:
    if layer is not None:
      raise ValueError(f"layer={layer!r} was given, but kv_cache of shape {shape} is one "
                       "layer's 4-D cache: layer= goes with a layered (cross-layer) cache only")
    return
  if layer is None:
    raise ValueError(f"kv_cache of shape {shape} is a layered (cross-layer) cache of "
                     f"{num_layers} layers: pass the layer index, layer=")
  if type(layer) is not int:
    raise TypeError(f"layer must be a Python int, got {type(layer).__name__}")
  if not 0 <= layer < num_layers:
    raise ValueError(f"layer={layer} is outside [0, {num_layers}): kv_cache holds {num_layers} "
                     "layers")


def copy_pages_back(entry: KeptCache, new, pages, layer, layer_axis: int) -> None:
  """CPU: copy the pages ``pages`` (block ids, numpy; of ``layer`` for a layered cache whose
  layer dim is at ``layer_axis``) of JAX's new cache ``new`` into the entry's torch buffer:
  one numpy copy of host memory per page, no copy of the rest."""
  src = np.asarray(new).view(np.uint8)           # zero-copy: JAX's CPU buffer
  dst = entry.host
  if dst is None or dst.shape != src.shape:
    dst = entry.host = host_bytes(entry.phys).reshape(src.shape)
  inner = () if layer is None else (slice(None),) * (layer_axis - 1) + (layer,)
  for page in pages.tolist():
    index = (page,) + inner
    dst[index] = src[index]
