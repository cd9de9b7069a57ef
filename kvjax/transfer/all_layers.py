"""A request's pages of every layer as one byte row per block (the wire form of one pull).

A rank's KV of all layers is either a list of L one-layer caches (each of the per-rank spec's
``physical_shape(B)``) or one layered (cross-layer) array, ``spec.physical_shape(B, L)``
(:mod:`kvjax.layers`). Either way a request's n blocks travel as uint8
``[n, L * page_bytes]``: row i is block i's page of layer 0, then layer 1, ... (each
``page_bytes`` long, the one-layer page). In an NHD layered array that row is one contiguous
run of the array (the layer axis follows the block axis); an HND layered array's layer axis is
moved next to the block axis in the gather and back in the scatter.
"""
from __future__ import annotations

import functools
from typing import Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from kvjax import pages, quant
from kvjax.transfer import execute as E

#: A rank's caches of all layers: L one-layer arrays, or one layered array.
RankLayers = Union[Sequence[jax.Array], jax.Array]


def is_layered(layers: RankLayers) -> bool:
  """True for one layered (5-D) array, False for a list of one-layer caches."""
  return hasattr(layers, "ndim")


def check_rank_layers(side: str, rank_layers: Sequence[RankLayers], spec) -> Tuple[int, int]:
  """Validate every rank's caches of all layers against the per-rank ``spec``; (L, B).

  Every rank must hold the same number of layers L >= 1 and blocks B; a layered array must be
  ``spec.physical_shape(B, L)`` (formats without a layered form are refused by the spec).
  """
  if not rank_layers:
    raise ValueError(f"{side} rank caches must be non-empty")
  shapes = []
  for r, layers in enumerate(rank_layers):
    if is_layered(layers):
      if not hasattr(spec, "blocks_and_layers"):
        raise ValueError(f"{type(spec).__name__} caches have no layered form: pass a list of "
                         "one-layer caches")
      b, num_layers = spec.blocks_and_layers(layers)
      if num_layers is None:
        raise ValueError(f"{side} rank {r}: a 4-D array is one layer; pass [cache] for one layer "
                         "or a layered array of all layers")
    else:
      layers = list(layers)
      if not layers:
        raise ValueError(f"{side} rank {r} has no layers")
      E.check_rank_caches(f"{side} rank {r}: layer", layers, spec)
      b, num_layers = int(layers[0].shape[0]), len(layers)
    shapes.append((num_layers, int(b)))
  if len(set(shapes)) != 1:
    raise ValueError(f"{side} ranks disagree on (layers, blocks): {shapes}")
  return shapes[0]


def device_of(layers: RankLayers) -> jax.Device:
  """The one device a rank's caches live on."""
  arrays = [layers] if is_layered(layers) else list(layers)
  devs = {E._device_of(a) for a in arrays}
  if len(devs) != 1:
    raise ValueError(f"a rank's layers must live on one device, got {sorted(map(str, devs))}")
  return devs.pop()


@functools.partial(jax.jit, static_argnums=(2,))
def _gather_layered(cache, block_ids, layer_axis: int):
  return E.to_bytes(jnp.moveaxis(cache[block_ids], layer_axis, 1))


@jax.jit
def _gather_list(caches, block_ids):
  return jnp.concatenate([E.to_bytes(c[block_ids]) for c in caches], axis=1)


def gather_layers(layers: RankLayers, block_ids, spec=None) -> jax.Array:
  """Blocks ``block_ids`` (int32 ``[n]``) of every layer: uint8 ``[n, L * page_bytes]``.

  ``spec`` (the per-rank spec) is needed for a layered array: where its layer axis is.
  """
  ids = np.asarray(block_ids, np.int32)
  if is_layered(layers):
    if spec is None:
      raise ValueError("a layered cache needs spec= (its layer axis depends on the layout)")
    return _gather_layered(layers, ids, spec.layer_axis)
  return _gather_list(list(layers), ids)


def layer_pages(rows: jax.Array, layer: int, page_bytes: int) -> jax.Array:
  """Layer ``layer``'s pages (uint8 ``[n, page_bytes]``) of rows ``[n, L * page_bytes]``."""
  return jax.lax.slice_in_dim(rows, layer * page_bytes, (layer + 1) * page_bytes, axis=1)


def _landed_layers(sources, spec, reads, permute: bool, remote_spec, num_layers: int):
  """Each layer's local pages (uint8 ``[n, page_bytes]``) from the pulled rows of the sources."""
  pb = remote_spec.page_bytes
  return [E.assemble_received(spec, {s: layer_pages(v, l, pb) for s, v in sources.items()},
                              reads, permute=permute, remote_spec=remote_spec)
          for l in range(num_layers)]


def _whole_pages(spec, reads, permute: bool, remote_spec) -> bool:
  """True when the plan reads every local page whole from one remote rank's page (same
  heads, same layout): the pulled rows then go into the caches as they are."""
  return (not permute and len(reads) == 1 and reads[0].remote_offset == 0
          and reads[0].length == spec.page_bytes == remote_spec.page_bytes)


def _as_table(cache):
  """A cache ``[B, ...]`` as its page rows ``[B, W]`` (free)."""
  return cache.reshape(cache.shape[0], -1)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6), donate_argnums=0)
def _land_list(caches, sources, block_ids, spec, reads, permute, remote_spec):
  if _whole_pages(spec, reads, permute, remote_spec):   # layer l: columns l * W of the rows
    (rows,) = sources.values()
    return [pages.store_pages(_as_table(c), rows, block_ids, column=l * _as_table(c).shape[1]
                              ).reshape(c.shape) for l, c in enumerate(caches)]
  landed = _landed_layers(sources, spec, reads, permute, remote_spec, len(caches))
  return [pages.store_pages(_as_table(c), p, block_ids).reshape(c.shape)
          for c, p in zip(caches, landed)]


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6), donate_argnums=0)
def _land_layered(cache, sources, block_ids, spec, reads, permute, remote_spec):
  if spec.layer_axis == 1 and _whole_pages(spec, reads, permute, remote_spec):
    (rows,) = sources.values()      # NHD: a block's pages of every layer are one run
  else:                             # assembled, and the layer axis moved into place (a copy)
    page_shape = list(cache.shape[1:])
    num_layers = page_shape.pop(spec.layer_axis - 1)
    landed = _landed_layers(sources, spec, reads, permute, remote_spec, num_layers)
    x = E.from_bytes(jnp.concatenate(landed, axis=1), (num_layers, *page_shape),
                     quant.bits_dtype(cache.dtype))
    rows = jnp.moveaxis(x, 1, spec.layer_axis).reshape(x.shape[0], -1)
  return pages.store_pages(_as_table(cache), rows, block_ids).reshape(cache.shape)


def _committed(layers: RankLayers) -> RankLayers:
  """The caches committed to their device (no copy), so that caches fresh from
  ``spec.allocate`` and the committed caches a pull returns share one compiled program. (Only
  uncommitted arrays are put: a device_put per array costs more than the pull of a small
  request.)"""
  if is_layered(layers):
    return layers if layers.committed else jax.device_put(layers, device_of(layers))
  layers = list(layers)
  if all(a.committed for a in layers):
    return layers
  device = device_of(layers)
  return [a if a.committed else jax.device_put(a, device) for a in layers]


def land_layers(layers: RankLayers, sources, block_ids, spec, reads, *, permute: bool,
                remote_spec) -> RankLayers:
  """Write a request's pulled rows into a rank's caches of every layer, in one program.

  sources: remote rank -> uint8 ``[n, L * remote_page_bytes]`` rows (on the rank's device);
  reads, permute: the rank's plan (:func:`kvjax.transfer.execute.rank_plan`).
  Returns the rank's new caches in the form given (a list, or one layered array); the given
  arrays are donated and updated in place. ``block_ids`` must be distinct (the pulls check
  it): the writes tell XLA so.
  """
  ids = np.asarray(block_ids, np.int32)
  reads = tuple(sorted(reads, key=lambda r: r.local_offset))
  sources = {int(k): v for k, v in sources.items()}
  layers = _committed(layers)
  if is_layered(layers):
    return _land_layered(layers, sources, ids, spec, reads, permute, remote_spec)
  return _land_list(list(layers), sources, ids, spec, reads, permute, remote_spec)


__all__ = ["RankLayers", "is_layered", "check_rank_layers", "device_of", "gather_layers",
           "layer_pages", "land_layers"]
