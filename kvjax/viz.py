"""Pictures of the packed cache: what every byte of one page holds.

matplotlib is optional (``pip install kvjax[viz]``); it is imported inside the
plotting functions only. :func:`page_byte_map` needs numpy alone.

CLI: ``python -m kvjax.viz --out docs/img`` draws ``page_layouts.png``. (The decode
bandwidth plot of the benchmarks is ``benchmarks/plot_decode.py``.)
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

from kvjax import quant
from kvjax.spec import KVCacheSpec

#: Byte categories of a page, in :func:`page_byte_map` codes.
UNUSED, K_DATA, K_SCALE, V_DATA, V_SCALE = 0, 1, 2, 3, 4
CATEGORY_NAMES = {UNUSED: "unused", K_DATA: "K data", K_SCALE: "K scale", V_DATA: "V data",
                  V_SCALE: "V scale"}
_BASE_COLORS = {UNUSED: (0.85, 0.85, 0.85), K_DATA: (0.12, 0.40, 0.75),
                K_SCALE: (0.05, 0.15, 0.35), V_DATA: (0.95, 0.55, 0.10),
                V_SCALE: (0.55, 0.15, 0.05)}

#: The small geometry the docs/formats.md picture uses: scale bytes stay visible next to data.
PICTURE_GEOMETRY = dict(num_kv_heads=2, head_size=32, block_size=16)
DEFAULT_PICTURE_FORMATS = (("auto", "NHD"), ("auto", "HND"), ("int8_per_token_head", "NHD"),
                           ("int8_per_token_head", "HND"), ("int4_per_token_head", "HND"),
                           ("nvfp4", "HND"))


def need_matplotlib():
  try:
    import matplotlib.pyplot as plt
  except ImportError as e:
    raise ImportError("kvjax.viz needs matplotlib: pip install kvjax[viz]") from e
  return plt


# -- the byte map of one page --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PageByteMap:
  """What each byte of one page holds, in memory order.

  Attributes:
    category: int8 ``[page_bytes]``, codes UNUSED, K_DATA, K_SCALE, V_DATA, V_SCALE.
    head: int32 ``[page_bytes]``, KV head of the byte (-1 when unused).
    token: int32 ``[page_bytes]``, token offset in the page (-1 when unused).
    row_bytes: bytes of one (head slot, token) row of the logical shape (the wrap width).
  """
  category: np.ndarray
  head: np.ndarray
  token: np.ndarray
  row_bytes: int

  @property
  def num_rows(self) -> int:
    return self.category.size // self.row_bytes


def _mark(bmap: Dict[str, np.ndarray], geometry, dims: Tuple[str, str], category: int,
          keep_last: Optional[int] = None):
  """Mark the bytes one view covers in a one-page geometry.

  geometry: a :class:`kvjax.ViewGeometry` of ``num_blocks=1`` with shape
  ``(1, a, b, x)`` whose a/b axes are named by ``dims`` ("token"/"head"); only the
  first ``keep_last`` elements of the last axis are marked (the data of a padded row).
  """
  shape = geometry.shape
  strides = geometry.strides
  item = np.dtype(geometry.dtype).itemsize
  x = shape[-1] if keep_last is None else keep_last
  idx = [np.arange(n) for n in (shape[1], shape[2], x)]
  a, b, c = np.meshgrid(*idx, indexing="ij")
  elem = geometry.offset + a * strides[1] + b * strides[2] + c * strides[3]
  first = elem * item
  names = {dims[0]: a, dims[1]: b}
  for k in range(item):
    addr = (first + k).ravel()
    if np.any(bmap["category"][addr] != UNUSED):
      raise AssertionError("two views claim the same byte: the spec's geometry overlaps")
    bmap["category"][addr] = category
    bmap["head"][addr] = names["head"].ravel()
    bmap["token"][addr] = names["token"].ravel()


def page_byte_map(spec: KVCacheSpec) -> PageByteMap:
  """Label every byte of one page of ``spec`` with (category, head, token).

  Built from the spec's own view geometry (``kv_view_geometry``,
  ``scale_view_geometry``, ``nvfp4_split_geometry``), so the picture shows the
  contract the kernels use, not a second description of it.
  """
  if not isinstance(spec, KVCacheSpec):
    raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
  nbytes = spec.page_bytes
  bmap = {"category": np.zeros(nbytes, np.int8), "head": np.full(nbytes, -1, np.int32),
          "token": np.full(nbytes, -1, np.int32)}
  codec = spec.codec
  if not codec.content_halves:          # nvfp4: head groups, each side [data | scales]
    for side, (cd, cs) in (("k", (K_DATA, K_SCALE)), ("v", (V_DATA, V_SCALE))):
      data, scale = spec.nvfp4_split_geometry(1, side)
      _mark(bmap, data, ("head", "token"), cd)
      _mark(bmap, scale, ("head", "token"), cs)
    if quant.nvfp4_v_scales_swizzled(spec.block_size, spec.num_scales_per_row):
      _unswizzle_v_scale_tokens(bmap, spec)
  else:
    kg, vg = spec.kv_view_geometry(1)
    _mark(bmap, kg, ("token", "head"), K_DATA, keep_last=spec.data_dim)
    _mark(bmap, vg, ("token", "head"), V_DATA, keep_last=spec.data_dim)
    if codec.has_row_scales:
      ks, vs = spec.scale_view_geometry(1)
      ks1 = dataclasses.replace(ks, shape=ks.shape + (1,), strides=ks.strides + (1,))
      vs1 = dataclasses.replace(vs, shape=vs.shape + (1,), strides=vs.strides + (1,))
      _mark(bmap, ks1, ("token", "head"), K_SCALE)
      _mark(bmap, vs1, ("token", "head"), V_SCALE)
  row = spec.content_dim * spec.itemsize
  return PageByteMap(bmap["category"], bmap["head"], bmap["token"], row)


def _unswizzle_v_scale_tokens(bmap, spec: KVCacheSpec):
  """nvfp4 V scales are 4x4-swizzled per (head) tile: relabel each byte with its real token."""
  n, s = spec.block_size, spec.num_scales_per_row
  idx = quant.nvfp4_v_swizzle_index(n, s)                 # flat tile position of (t, s)
  token_at = np.empty(n * s, np.int32)
  token_at[idx.ravel()] = np.repeat(np.arange(n), s)
  where = np.nonzero(bmap["category"] == V_SCALE)[0]      # memory order: head-major tiles
  tile = (where - where[0]) % (n * s)
  bmap["token"][where] = token_at[tile]


def page_image(bmap: PageByteMap, num_heads: int) -> np.ndarray:
  """RGB float image ``[rows, row_bytes, 3]``: colour = category, lighter for later heads."""
  base = np.array([_BASE_COLORS[c] for c in range(5)], np.float32)
  rgb = base[bmap.category.astype(np.int64)]
  if num_heads > 1:
    light = np.where(bmap.head < 0, 0.0, bmap.head / (num_heads - 1) * 0.55)[:, None]
    rgb = rgb + (1.0 - rgb) * light
  return rgb.reshape(bmap.num_rows, bmap.row_bytes, 3)


def _describe(spec: KVCacheSpec) -> str:
  return (f"{spec.cache_dtype} {spec.layout}: page {spec.page_bytes:,} B, "
          f"physical {spec.physical_shape(1)[1:]}")


def plot_page_layout(spec: KVCacheSpec, ax=None, path: Optional[str] = None, legend: bool = True):
  """Draw one page of ``spec`` byte by byte, in memory order.

  Each image row is one ``row_bytes`` stretch of memory (one (head slot, token) row of
  the logical shape); colour says K data / K scale / V data / V scale, lighter shades
  are later heads, the y labels name the (token, head) a row starts with.
  With ``path`` the figure is saved as PNG. Returns the matplotlib Axes.
  """
  plt = need_matplotlib()
  bmap = page_byte_map(spec)
  own = ax is None
  if own:
    fig, ax = plt.subplots(figsize=(7, 5), constrained_layout=True)
  img = page_image(bmap, spec.num_kv_heads)
  ax.imshow(img, aspect="auto", interpolation="nearest")
  rows = bmap.num_rows
  step = max(1, -(-rows // 32))
  ticks = list(range(0, rows, step))
  starts = np.asarray(ticks) * bmap.row_bytes
  labels = [f"t{bmap.token[i]} h{bmap.head[i]}" for i in starts]
  ax.set_yticks(ticks)
  ax.set_yticklabels(labels, fontsize=6)
  ax.set_xlabel(f"byte within a {bmap.row_bytes}-byte row", fontsize=8)
  ax.tick_params(axis="x", labelsize=7)
  ax.set_title(_describe(spec), fontsize=9)
  if legend:
    ax.legend(handles=_legend_handles([bmap], spec.num_kv_heads), fontsize=6,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
  if own and path is not None:
    ax.figure.savefig(path, dpi=130)
    plt.close(ax.figure)
  return ax


def _legend_handles(bmaps, num_heads: int):
  from matplotlib.patches import Patch
  present = sorted(set().union(*(np.unique(b.category).tolist() for b in bmaps)) - {UNUSED})
  handles = [Patch(color=_BASE_COLORS[c], label=CATEGORY_NAMES[c]) for c in present]
  if num_heads > 1:
    handles.append(Patch(color=(0.75, 0.75, 0.75),
                         label=f"lighter shade = later head (h0..h{num_heads - 1})"))
  return handles


def default_picture_specs() -> Sequence[KVCacheSpec]:
  """The specs of the docs/formats.md picture: bf16 NHD/HND, int8 NHD/HND, int4 HND, nvfp4 HND."""
  return [KVCacheSpec(cache_dtype=c, layout=lay, **PICTURE_GEOMETRY)
          for c, lay in DEFAULT_PICTURE_FORMATS]


def plot_page_layouts(specs: Optional[Iterable[KVCacheSpec]], path: str, ncols: int = 2):
  """A grid of :func:`plot_page_layout` pictures saved as PNG at ``path``; returns ``path``."""
  plt = need_matplotlib()
  specs = list(default_picture_specs() if specs is None else specs)
  if not specs:
    raise ValueError("specs is empty")
  ncols = max(1, min(ncols, len(specs)))
  nrows = -(-len(specs) // ncols)
  fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.2 * nrows),
                           constrained_layout=True, squeeze=False)
  for i, ax in enumerate(axes.ravel()):
    if i < len(specs):
      plot_page_layout(specs[i], ax=ax, legend=False)
    else:
      ax.axis("off")
  s0 = specs[0]
  handles = _legend_handles([page_byte_map(s) for s in specs], max(s.num_kv_heads for s in specs))
  fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=9)
  fig.suptitle(f"One page of the packed paged KV cache, byte by byte in memory order "
               f"(H={s0.num_kv_heads}, N={s0.block_size}, D={s0.head_size})", fontsize=11)
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


# -- CLI ----------------------------------------------------------------------------------------
def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m kvjax.viz", description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="docs/img", help="output folder (default docs/img)")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  p = plot_page_layouts(None, os.path.join(args.out, "page_layouts.png"))
  print(f"wrote {p}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
