"""Plot the decode benchmark: KV bytes read per second per (kernel, cache dtype, layout), and
each cache format's speed relative to bf16.

``python benchmarks/plot_decode.py --results decode.json [--out decode_bandwidth.png]
[--formats bfloat16,fp8] [--kernels triton] [--speedup-out decode_speedup.png]`` (needs
matplotlib: ``pip install kvjax[viz]``).

``--results`` takes the JSON of a ``bench_decode.py --json PATH`` run.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from kvjax.viz import need_matplotlib

#: Decode read rates of other kernels measured on the H200 (bf16, 32 q heads, 8 KV heads,
#: D=128, block 16), TB/s, {(batch, context): rate}; quoted in RESULTS.md, not re-run by
#: bench_decode.py.
VLLM_TRITON_ANCHORS = {(64, 4096): 3.7, (128, 2048): 3.7, (16, 16384): 2.5, (8, 32768): 2.4,
                       (256, 1024): 3.6}
JAX_BUILTIN_ANCHORS = {(64, 4096): 1.5, (128, 2048): 1.45, (16, 16384): 1.55, (8, 32768): 1.6,
                       (256, 1024): 1.4}
STREAMING_READ_TB_S = 4.5     # a streaming Triton read kernel on the H200


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


def _footer(fig, data):
  """The run's versions and command under a figure."""
  versions = data.get("versions") or {}
  foot = ", ".join(f"{k} {v}" for k, v in versions.items())
  if data.get("command"):
    foot = (foot + "\n" if foot else "") + f"$ {data['command']}"
  if foot:
    fig.text(0.01, -0.01, foot, fontsize=6, va="top", family="monospace")


def plot_decode_bandwidth(results_json, path: str, h200_anchors: Optional[bool] = None,
                          formats=None, kernels=None):
  """KV bytes read per second vs batch x context, one line per (kernel, cache dtype, layout).

  Draws the JSON's copy-rate ceiling (``copy_tb_s``) and, for an H200 run
  (``h200_anchors=None``: when "H200" is in ``device``), the streaming-read ceiling
  (4.5 TB/s) and the anchors of vLLM's Triton kernel and JAX's built-in Pallas
  kernel at the shapes they were measured at. Rows with several ``config`` values
  get one line per config; ``formats`` / ``kernels`` (sequences of names, None: all) keep
  those rows only. Saves a PNG at ``path``; returns ``path``.
  """
  plt = need_matplotlib()
  data = load_decode_results(results_json)
  rows = [r for r in data["rows"] if (formats is None or r["cache_dtype"] in formats)
          and (kernels is None or r["kernel"] in kernels)]
  if not rows:
    raise ValueError(f"no decode results row of formats={formats} and kernels={kernels}")
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
  _footer(fig, data)
  fig.savefig(path, dpi=130, bbox_inches="tight")
  plt.close(fig)
  return path


def plot_decode_speedup(results_json, path: str, kernel: str = "triton", formats=None):
  """Each cache format's decode tokens/s relative to the bf16 cache (same shape and layout),
  ``kernel``'s rows: a bar from the lowest to the highest over the shapes per layout, the
  ideal (bf16's bytes over the format's, ``1 / bytes_vs_bf16``) as a mark, and vLLM's
  kernel on the same format relative to the same bf16 row where the run has it
  (``vllm_us``); ``formats`` (None: all) keeps those cache dtypes. Saves a PNG at ``path``;
  returns ``path``."""
  plt = need_matplotlib()
  data = load_decode_results(results_json)
  rows = [r for r in data["rows"] if r["kernel"] == kernel]
  base = {(r["batch"], r["context"], r["layout"]): float(r["us"]) for r in rows
          if r.get("bytes_vs_bf16") == 1.0 and "us" in r}
  rows = [r for r in rows if formats is None or r["cache_dtype"] in formats]
  need = ("x_bf16", "bytes_vs_bf16", "us")
  if not rows or any(k not in r for r in rows for k in need):
    raise ValueError(f"decode results need {kernel!r} rows with {need}")
  formats = list(dict.fromkeys(r["cache_dtype"] for r in rows))
  layouts = ("NHD", "HND")
  fig, ax = plt.subplots(figsize=(11, 4.6), constrained_layout=True)
  width = 0.38
  vllm_label = "vLLM 0.28 Triton, same cache"
  for j, layout in enumerate(layouts):
    for i, cd in enumerate(formats):
      sel = [r for r in rows if r["cache_dtype"] == cd and r["layout"] == layout]
      if not sel:
        continue
      x = i + (j - 0.5) * width
      ours = [float(r["x_bf16"]) for r in sel]
      ax.bar(x, max(ours) - min(ours) or 0.01, width * 0.9, bottom=min(ours),
             color=("tab:blue", "tab:orange")[j], label=f"kvjax {kernel} ({layout})"
             if i == 0 else None)
      ax.plot(x, 1.0 / float(sel[0]["bytes_vs_bf16"]), marker="_", markersize=18,
              color="0.2", label="ideal: bf16 bytes / format bytes" if (i, j) == (0, 0)
              else None)
      vllm = [base[(r["batch"], r["context"], layout)] / float(r["vllm_us"]) for r in sel
              if r.get("vllm_us") and (r["batch"], r["context"], layout) in base]
      if vllm:
        ax.plot([x] * len(vllm), vllm, linestyle="none", marker="*", markersize=8,
                color="0.35", label=vllm_label)
        vllm_label = None                                    # one legend entry
  ax.axhline(1.0, color="0.5", linewidth=0.8)
  ax.set_xticks(range(len(formats)))
  ax.set_xticklabels(formats, rotation=15, fontsize=8)
  ax.set_ylabel("decode tokens/s relative to the bf16 cache")
  ax.set_ylim(0, None)
  ax.grid(True, axis="y", alpha=0.3)
  ax.set_title(f"Decode speed per cache format (bars: lowest to highest of the run's shapes) — "
               f"{data.get('device', '?')}, {data.get('date', '?')}", fontsize=10)
  ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), framealpha=0.9)
  _footer(fig, data)
  fig.savefig(path, dpi=130, bbox_inches="tight")
  plt.close(fig)
  return path


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--results", required=True, help="a bench_decode.py --json file")
  parser.add_argument("--out", default="decode_bandwidth.png")
  parser.add_argument("--formats", default=None, help="cache dtypes to draw (default: all)")
  parser.add_argument("--kernels", default=None, help="kernels to draw (default: all)")
  parser.add_argument("--speedup-out", default=None,
                      help="also draw the per-format speed relative to bf16 here")
  parser.add_argument("--speedup-formats", default=None,
                      help="cache dtypes of that figure (default: all)")
  args = parser.parse_args(argv)
  split = lambda text: None if text is None else tuple(x for x in text.split(",") if x)
  path = plot_decode_bandwidth(args.results, args.out, formats=split(args.formats),
                               kernels=split(args.kernels))
  print(f"wrote {path}")
  if args.speedup_out:
    path = plot_decode_speedup(args.results, args.speedup_out,
                               formats=split(args.speedup_formats))
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
