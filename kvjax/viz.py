"""Pictures of the packed cache: one page's bytes, and decode read rates from a benchmark JSON.

matplotlib is optional (``pip install kvjax[viz]``); it is imported inside the
plotting functions only. :func:`page_byte_map` needs numpy alone.

CLI: ``python -m kvjax.viz --out docs/img`` draws ``page_layouts.png`` and, when
``benchmarks/results/decode.json`` exists, ``decode_bandwidth.png``.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Dict, Iterable, Optional, Sequence, Tuple

import numpy as np

from kvjax import formats as F
from kvjax.spec import KVCacheSpec

#: Byte categories of a page, in :func:`page_byte_map` codes.
UNUSED, K_DATA, K_SCALE, V_DATA, V_SCALE = 0, 1, 2, 3, 4
CATEGORY_NAMES = {UNUSED: "unused", K_DATA: "K data", K_SCALE: "K scale", V_DATA: "V data",
                  V_SCALE: "V scale"}
_BASE_COLORS = {UNUSED: (0.85, 0.85, 0.85), K_DATA: (0.12, 0.40, 0.75),
                K_SCALE: (0.05, 0.15, 0.35), V_DATA: (0.95, 0.55, 0.10),
                V_SCALE: (0.55, 0.15, 0.05)}

#: Decode read rates measured on the H200 (bf16, 32 q heads, 8 KV heads, D=128, block 16),
#: TB/s, from shared/spec/platform_notes.md: {(batch, context): rate}.
VLLM_TRITON_ANCHORS = {(64, 4096): 3.7, (128, 2048): 3.7, (16, 16384): 2.5, (8, 32768): 2.4,
                       (256, 1024): 3.6}
JAX_BUILTIN_ANCHORS = {(64, 4096): 1.5, (128, 2048): 1.45, (16, 16384): 1.55, (8, 32768): 1.6,
                       (256, 1024): 1.4}
STREAMING_READ_TB_S = 4.5     # a streaming Triton read kernel on the H200
HBM_PEAK_TB_S = 4.8           # datasheet

#: The small geometry the README picture uses: scale bytes stay visible next to data.
PICTURE_GEOMETRY = dict(num_kv_heads=2, head_size=32, block_size=16)
DEFAULT_PICTURE_FORMATS = (("auto", "NHD"), ("auto", "HND"), ("int8_per_token_head", "NHD"),
                           ("int8_per_token_head", "HND"), ("int4_per_token_head", "HND"),
                           ("nvfp4", "HND"))


def _need_matplotlib():
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
  kind = spec.format.kind
  if kind == F.NVFP4:
    for side, (cd, cs) in (("k", (K_DATA, K_SCALE)), ("v", (V_DATA, V_SCALE))):
      data, scale = spec.nvfp4_split_geometry(1, side)
      _mark(bmap, data, ("head", "token"), cd)
      _mark(bmap, scale, ("head", "token"), cs)
    if spec.num_scales_per_row % 4 == 0:
      _unswizzle_v_scale_tokens(bmap, spec)
  else:
    kg, vg = spec.kv_view_geometry(1)
    _mark(bmap, kg, ("token", "head"), K_DATA, keep_last=spec.data_dim)
    _mark(bmap, vg, ("token", "head"), V_DATA, keep_last=spec.data_dim)
    if kind == F.PER_TOKEN_HEAD:
      ks, vs = spec.scale_view_geometry(1)
      ks1 = dataclasses.replace(ks, shape=ks.shape + (1,), strides=ks.strides + (1,))
      vs1 = dataclasses.replace(vs, shape=vs.shape + (1,), strides=vs.strides + (1,))
      _mark(bmap, ks1, ("token", "head"), K_SCALE)
      _mark(bmap, vs1, ("token", "head"), V_SCALE)
  row = spec.content_dim * spec.itemsize
  return PageByteMap(bmap["category"], bmap["head"], bmap["token"], row)


def _unswizzle_v_scale_tokens(bmap, spec: KVCacheSpec):
  """nvfp4 V scales are 4x4-swizzled per (head) tile: relabel each byte with its real token."""
  from kvjax import quant
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
  plt = _need_matplotlib()
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
  """The specs of the README picture: bf16 NHD/HND, int8 NHD/HND, int4 HND, nvfp4 HND."""
  return [KVCacheSpec(cache_dtype=c, layout=lay, **PICTURE_GEOMETRY)
          for c, lay in DEFAULT_PICTURE_FORMATS]


def plot_page_layouts(specs: Optional[Iterable[KVCacheSpec]], path: str, ncols: int = 2):
  """A grid of :func:`plot_page_layout` pictures saved as PNG at ``path``; returns ``path``."""
  plt = _need_matplotlib()
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


# -- decode bandwidth ----------------------------------------------------------------------------
_REQUIRED_ROW_KEYS = ("kernel", "cache_dtype", "layout", "batch", "context", "tb_per_s")


def load_decode_results(results_json) -> dict:
  """Read and check a decode benchmark JSON (a path or an already loaded dict)."""
  if isinstance(results_json, dict):
    data = results_json
  else:
    with open(results_json) as f:
      data = json.load(f)
  rows = data.get("rows")
  if not isinstance(rows, list) or not rows:
    raise ValueError("decode results need a non-empty 'rows' list")
  for i, r in enumerate(rows):
    missing = [k for k in _REQUIRED_ROW_KEYS if k not in r]
    if missing:
      raise ValueError(f"decode results row {i} lacks {missing}")
  return data


def plot_decode_bandwidth(results_json, path: str, h200_anchors: Optional[bool] = None):
  """KV bytes read per second vs batch x context, one line per (kernel, cache dtype, layout).

  Draws the JSON's copy-rate ceiling (``copy_tb_s``) and, for an H200 run
  (``h200_anchors=None``: when "H200" is in ``device``), the streaming-read ceiling
  (4.5 TB/s) and the anchors of vLLM's Triton kernel and JAX's built-in Pallas
  kernel at the shapes they were measured at. Rows with several ``config`` values
  get one line per config. Saves a PNG at ``path``; returns ``path``.
  """
  plt = _need_matplotlib()
  data = load_decode_results(results_json)
  rows = data["rows"]
  if h200_anchors is None:
    h200_anchors = "H200" in str(data.get("device", ""))
  shapes = sorted({(int(r["batch"]), int(r["context"])) for r in rows},
                  key=lambda bc: (bc[0] * bc[1], bc[1]))
  xpos = {bc: i for i, bc in enumerate(shapes)}
  fig, ax = plt.subplots(figsize=(11, 5.2), constrained_layout=True)
  series = {}
  for r in rows:
    key = (r["kernel"], r["cache_dtype"], r["layout"], str(r.get("config") or "default"))
    series.setdefault(key, []).append((xpos[(int(r["batch"]), int(r["context"]))],
                                       float(r["tb_per_s"])))
  markers = {"kvjax": "o", "jax_builtin": "s", "torch_sdpa": "^"}
  for key in sorted(series):
    pts = sorted(series[key])
    xs, ys = zip(*pts)
    kernel, cdt, lay, cfg = key
    extra = "" if cfg == "default" else f", {cfg}"
    ax.plot(xs, ys, marker=markers.get(kernel, "D"), linewidth=1.6,
            label=f"{kernel} ({cdt}, {lay}{extra})")
  anchor_sets = ((VLLM_TRITON_ANCHORS, "vLLM 0.28 Triton (H200 anchor)", "*"),
                 (JAX_BUILTIN_ANCHORS, "JAX built-in paged_attention (H200 anchor)", "x"))
  for anchors, name, style in anchor_sets if h200_anchors else ():
    pts = [(xpos[bc], v) for bc, v in anchors.items() if bc in xpos]
    if pts:
      xs, ys = zip(*sorted(pts))
      ax.plot(xs, ys, linestyle="none", marker=style, markersize=10, color="0.35", label=name)
  copy = data.get("copy_tb_s")
  if copy:
    ax.axhline(float(copy), color="tab:red", linestyle="--", linewidth=1,
               label=f"device copy rate {float(copy):.3g} TB/s (read + write)")
  if h200_anchors:
    ax.axhline(STREAMING_READ_TB_S, color="0.2", linestyle=":", linewidth=1,
               label=f"streaming read ceiling {STREAMING_READ_TB_S} TB/s (H200)")
  ax.set_xticks(range(len(shapes)))
  ax.set_xticklabels([f"{b}×{c}" for b, c in shapes], rotation=30, fontsize=8)
  ax.set_xlabel("batch × context (tokens)")
  ax.set_ylabel("KV bytes read per second (TB/s)")
  ymax = max([STREAMING_READ_TB_S if h200_anchors else 0.0, float(copy or 0)]
             + [float(r["tb_per_s"]) for r in rows]) or 1.0
  ax.set_ylim(0, ymax * 1.12)
  ax.grid(True, axis="y", alpha=0.3)
  ax.set_title(f"Paged decode attention, KV read rate — {data.get('device', '?')}, "
               f"{data.get('date', '?')}", fontsize=10)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
  versions = data.get("versions") or {}
  foot = ", ".join(f"{k} {v}" for k, v in versions.items())
  if data.get("command"):
    foot = (foot + "\n" if foot else "") + f"$ {data['command']}"
  if foot:
    fig.text(0.01, -0.01, foot, fontsize=6, va="top", family="monospace")
  fig.savefig(path, dpi=130, bbox_inches="tight")
  plt.close(fig)
  return path


# -- CLI ----------------------------------------------------------------------------------------
def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m kvjax.viz", description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="docs/img", help="output folder (default docs/img)")
  parser.add_argument("--results", default=os.path.join("benchmarks", "results", "decode.json"),
                      help="decode benchmark JSON (drawn when it exists)")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  p = plot_page_layouts(None, os.path.join(args.out, "page_layouts.png"))
  print(f"wrote {p}")
  if os.path.exists(args.results):
    p = plot_decode_bandwidth(args.results, os.path.join(args.out, "decode_bandwidth.png"))
    print(f"wrote {p}")
  else:
    print(f"skipped decode_bandwidth.png: {args.results} not found")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
