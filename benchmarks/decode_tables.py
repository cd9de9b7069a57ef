"""The decode benchmark's tables (what benchmarks/RESULTS.md quotes): every row as markdown,
the per-format summary over the shapes, and both printed again from saved runs' JSONs
(``bench_decode.py --summarize``)."""
from __future__ import annotations

import json


def markdown(rows):
  """The per-format table as markdown (what RESULTS.md quotes)."""
  out = ["| batch x ctx | format | layout | kernel | µs | tokens/s vs bf16 | TB/s (own bytes) | "
         "bytes vs bf16 | vLLM 0.28 µs |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    out.append(f"| {r['batch']}x{r['context']} | {r['cache_dtype']} | {r['layout']} | "
               f"{r['kernel']} | {r['us']} | {r.get('x_bf16', '-')} | {r['tb_per_s']} | "
               f"{r['bytes_vs_bf16']} | {r.get('vllm_us', '-')} |")
  return "\n".join(out)


def _span(values, fmt="{:.2f}"):
  """``lo–hi`` of values (one value: itself), or ``-``."""
  if not values:
    return "-"
  lo, hi = min(values), max(values)
  return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}–{fmt.format(hi)}"


def summary(rows, peers, kernels):
  """The per-format table (markdown): bytes vs bf16, the ideal speedup, and for each kernel
  its tokens/s vs its bf16 cache over the shapes (NHD / HND ranges); vLLM's tokens/s vs the
  same bf16 baseline; each further kernel's time over the first kernel's at the same shape
  and layout; a last row with each bf16 kernel's tokens/s vs torch SDPA on dense KV at the
  same shapes."""
  formats = list(dict.fromkeys(r["cache_dtype"] for r in rows))
  others = tuple(kernels[1:])
  head = (["format", "bytes vs bf16", "ideal"] + [f"{k} NHD / HND" for k in kernels]
          + ["vLLM 0.28 NHD / HND"] + [f"{k} time / {kernels[0]}'s" for k in others])
  out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for fmt in formats:
    mine = [r for r in rows if r["cache_dtype"] == fmt]
    ratio = mine[0]["bytes_vs_bf16"]
    cells = [fmt, f"{ratio:.3f}", f"{1 / ratio:.2f}"]
    columns = ([("x_bf16", k) for k in kernels] + [("vllm", "vllm")]
               + [("time", k) for k in others])
    for what, k in columns:
      parts = []
      for layout in ("NHD", "HND"):
        sel = [r for r in mine if r["layout"] == layout and
               (r["kernel"] == k if what != "vllm" else "vllm_us" in r)]
        if what == "vllm":   # vs the first kernel's bf16 row of the same shape and layout
          vals = [r["us"] / r["vllm_us"] * r.get("x_bf16", 1) for r in sel]
        elif what == "time":   # over the first kernel's time at the same shape and layout
          first = {(r["batch"], r["context"]): r["us"] for r in mine
                   if r["layout"] == layout and r["kernel"] == kernels[0]}
          vals = [r["us"] / first[(r["batch"], r["context"])] for r in sel
                  if (r["batch"], r["context"]) in first]
        else:
          vals = [r["x_bf16"] for r in sel if "x_bf16" in r]
        parts.append(_span(vals))
      cells.append(" / ".join(parts))
    out.append("| " + " | ".join(cells) + " |")
  sdpa = {(p["batch"], p["context"]): p["ms"] for p in peers if p["kernel"] == "torch_sdpa"}
  cells = ["bf16 vs torch SDPA (dense)", "-", "-"]
  for k in kernels:
    vals = [sdpa[(r["batch"], r["context"])] * 1e3 / r["us"] for r in rows
            if r["kernel"] == k and r["cache_dtype"] == "bfloat16"
            and (r["batch"], r["context"]) in sdpa]
    cells.append(_span(vals))
  out.append("| " + " | ".join(cells + ["-"] * (1 + len(others))) + " |")
  return "\n".join(out)


def summarize(paths):
  """Print the tables of saved runs' JSONs (``--json``), their rows and peers merged in order
  (one run cut short by a time limit and another with the shapes it missed, on one machine)."""
  rows, peers = [], []
  for path in paths:
    with open(path) as f:
      data = json.load(f)
    print(json.dumps({k: data.get(k) for k in ("device", "date", "versions", "command")}))
    rows += data["rows"]
    peers += data.get("peers", [])
  kernels = tuple(dict.fromkeys(r["kernel"] for r in rows))
  print(markdown(rows))
  print(summary(rows, peers, kernels))
