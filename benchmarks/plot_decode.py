"""Plot the decode benchmark: KV bytes read per second per (kernel, cache dtype, layout).

``python benchmarks/plot_decode.py [--results benchmarks/results/decode.json]
[--out docs/img/decode_bandwidth.png]`` (needs matplotlib: ``pip install kvjax[viz]``).
"""
from __future__ import annotations

import argparse
import json
import os
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


def plot_decode_bandwidth(results_json, path: str, h200_anchors: Optional[bool] = None):
  """KV bytes read per second vs batch x context, one line per (kernel, cache dtype, layout).

  Draws the JSON's copy-rate ceiling (``copy_tb_s``) and, for an H200 run
  (``h200_anchors=None``: when "H200" is in ``device``), the streaming-read ceiling
  (4.5 TB/s) and the anchors of vLLM's Triton kernel and JAX's built-in Pallas
  kernel at the shapes they were measured at. Rows with several ``config`` values
  get one line per config. Saves a PNG at ``path``; returns ``path``.
  """
  plt = need_matplotlib()
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


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  here = os.path.dirname(os.path.abspath(__file__))
  parser.add_argument("--results", default=os.path.join(here, "results", "decode.json"))
  parser.add_argument("--out", default=os.path.join(here, "..", "docs", "img",
                                                    "decode_bandwidth.png"))
  args = parser.parse_args(argv)
  print(f"wrote {plot_decode_bandwidth(args.results, args.out)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
