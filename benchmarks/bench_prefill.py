"""Prefill benchmark: kvjax's paged attention kernels and dense peers, in one run.

GPU (H200, about 4 minutes):
  PYTHONUNBUFFERED=1 python benchmarks/bench_prefill.py [--json PATH] [--md PATH]
      [--parts checks,table,formats] [--layout NHD|HND]
CPU smoke (interpret mode, < 1 minute):
  python benchmarks/bench_prefill.py --smoke

Parts (``--parts``, default all):
  checks   compiled correctness of ``kvjax.unified_attention`` with impl="pallas" (the Triton
           kernels) and impl="mosaic_gpu" vs impl="reference" on three ragged mixes (prefill,
           cached prefix, decode, padding; bf16, int8 per token-head with window + soft cap +
           sinks, fp8 per tensor), NaN in every cache slot no token was written to, metadata
           traced under jax.jit;
  table    rows: 4x4096, 16x1024, 1x16384 causal prefill, a serving mix (1x4096 prefill + 64 decodes
           at 4096) and its two parts alone; columns: kvjax Triton (``impl="pallas"``), kvjax Mosaic
           GPU (``impl="mosaic_gpu"``, skipped with the registry's reason where it cannot run, e.g.
           jax < 0.11 or no Hopper GPU), kvjax ``impl="auto"`` (the pick named), all through the
           paged cache (bf16, pages shuffled); on dense KV (equal-length prefills only) JAX's
           ``attention_mgpu`` (float16), cuDNN via ``jax.nn.dot_product_attention`` and torch SDPA
           with ``enable_gqa`` (when torch has CUDA). Cells: TFLOP/s (ms);
  formats  every cache format on a 4x4096 causal prefill (NHD; nvfp4 HND) through the Triton
           ragged kernel (``impl="pallas"``: quantized pages read through a plain copy where
           that pays), through ``impl="auto"`` and through the Mosaic GPU ragged kernel reading
           quantized pages through a plain copy and as stored (where it can): TFLOP/s (ms) and
           % of the bf16 cache's TFLOP/s in the same column (target >= 97 %: FORMAT_TARGET).
Shape: bf16, Hq 32, H 8 (GQA 4), D 128, block 16. FLOPs = 4 * Hq * D * (visible query-key
pairs) (``benchmarks/prefill_peers.py``); a causal S x L prefill has S * L * (L + 1) / 2.
Timing: ``benchmarks/common.py`` (median of 5 means of 10 back-to-back calls after 2 warm-up
calls; torch through CUDA events). Results print as they come and as markdown tables at the end;
``--json`` (default ``$OUT/prefill.json`` when $OUT is set) is rewritten after every part;
``--md`` (default ``$OUT/prefill.md``) gets the tables.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import kvjax  # noqa: E402
from benchmarks import common  # noqa: E402
from benchmarks import prefill_peers as P  # noqa: E402

PARTS = ("checks", "table", "formats")
KVJAX_COLUMNS = (("kvjax Triton (paged)", "pallas"), ("kvjax Mosaic GPU (paged)", "mosaic_gpu"),
                 ("kvjax auto (paged)", "auto"))
CHECK_IMPLS = ("pallas", "mosaic_gpu")
#: The formats part's Mosaic GPU columns: quantized pages through a plain copy, and as stored.
READ_COLUMNS = (("Mosaic GPU, plain copy", "copy"), ("Mosaic GPU, as stored", "direct"))
#: Each cache format's prefill TFLOP/s over the bf16 cache's in the same column, at least.
FORMAT_TARGET = 0.97

# (name, H, Hq, D, N, layout, cache_dtype, q_lens, ctx_lens, pad, kwargs; "sinks": drawn)
CHECK_MIXES = (
    ("NHD bf16 G=4 D=128: prefill/prefix/decode + pad", 8, 32, 128, 16, "NHD", "auto",
     [300, 1, 1, 77, 512, 1], [0, 1000, 37, 500, 64, 3], 13, {}),
    ("HND int8/token-head G=7 D=96 N=32 window+softcap+sinks", 2, 14, 96, 32, "HND",
     "int8_per_token_head", [200, 1, 64, 3], [100, 700, 0, 90], 5,
     dict(sliding_window=128, soft_cap=30.0, sinks=True)),
    ("NHD fp8 per tensor (scale 0.5) G=1 D=64 N=64", 4, 4, 64, 64, "NHD", "fp8",
     [128, 5, 1], [64, 300, 1000], 0, dict(k_scale=0.5, v_scale=0.5)),
)
SMOKE_CHECK_MIXES = (
    ("smoke NHD bf16 G=2 D=64", 2, 4, 64, 16, "NHD", "auto", [20, 1, 9], [0, 40, 17], 3, {}),
)


say = functools.partial(print, flush=True)


# -- part checks ------------------------------------------------------------------------------
def run_checks(smoke: bool) -> list:
  """Each mix: every impl of CHECK_IMPLS vs the reference; rows of ``P.compare`` + name."""
  rng = np.random.default_rng(0)
  rows = []
  for name, h, hq, d, n, layout, cd, ql, cl, pad, kw in (SMOKE_CHECK_MIXES if smoke
                                                          else CHECK_MIXES):
    kw = dict(kw)
    spec = kvjax.KVCacheSpec(h, d, n, cd, layout=layout, dtype=jnp.bfloat16)
    args = P.paged_batch(rng, spec, ql, cl, hq, pad=pad, fill="nan", scales=kw.get("k_scale"))
    if kw.pop("sinks", False):
      kw["sinks"] = jnp.asarray(rng.standard_normal(hq) * 2, jnp.float32)
    mql = max(ql)
    ref = P.kvjax_fn(spec, "reference", mql, **kw)(*args)
    for impl in CHECK_IMPLS:
      row = dict(name=name, impl=impl)
      why = P.impl_reason(spec, jnp.bfloat16, impl)
      if why is not None:
        row.update(skipped=why)
        say(f"[check] {impl:>10} | {name}: skipped ({why})")
      else:
        try:
          row.update(P.compare(P.kvjax_fn(spec, impl, mql, **kw)(*args), ref, sum(ql)))
          say(f"[check] {impl:>10} | {name}: max err {row['max_err']:.2e} (ref max "
              f"{row['ref_max']:.2f}), rel L2 {row['rel_err']:.2e}, padding zero "
              f"{row['padding_zero']} -> {'OK' if row['ok'] else 'FAIL'}")
        except Exception as e:  # noqa: BLE001 - report and go on
          row.update(ok=False, error=common.first_lines(e))
          say(f"[check] {impl:>10} | {name}: FAIL {row['error']}")
      rows.append(row)
  return rows


# -- part table -------------------------------------------------------------------------------
def record(rows, part, problem, column, flops, result, **extra):
  row = dict(part=part, problem=problem, column=column, flops=flops, **extra, **result)
  if "ms" in row:
    row["tflops"] = P.tflops(flops, row["ms"])
    pick = f" [{row['pick']}]" if "pick" in row else ""
    say(f"[{part}] {problem} | {column}{pick}: {row['ms']:.3f} ms, {row['tflops']:.1f} TFLOP/s")
  elif "skipped" in row:
    say(f"[{part}] {problem} | {column}: skipped ({row['skipped']})")
  else:
    say(f"[{part}] {problem} | {column}: FAILED {row['error']}")
  rows.append(row)


def run_table(smoke: bool, layout: str) -> list:
  """Every problem x (kvjax columns through the paged cache, dense peers)."""
  rng = np.random.default_rng(1)
  timing = P.SMOKE_TIMING if smoke else P.TIMING
  spec = kvjax.KVCacheSpec(P.H, P.D, P.N, layout=layout, dtype=jnp.bfloat16)
  rows = []
  for problem, ql, cl in (P.SMOKE_PROBLEMS if smoke else P.PROBLEMS):
    flops, mql = P.attention_flops(ql, cl), max(ql)
    args = P.paged_batch(rng, spec, ql, cl)
    pick = P.auto_choice(spec, args[0], args[3], args[4], mql).name
    for column, impl in KVJAX_COLUMNS:
      extra = dict(pick=pick) if impl == "auto" else {}
      record(rows, "table", problem, column, flops,
             P.measure(P.kvjax_thunk(spec, impl, args, mql, timing)), **extra)
    del args
    if len(set(ql)) == 1 and not any(cl):
      for column, thunk in P.dense_peers(len(ql), ql[0], timing):
        record(rows, "table", problem, column, flops, P.measure(thunk))
    else:
      for column in P.DENSE_PEERS:
        record(rows, "table", problem, column, flops,
               dict(skipped="dense peers: equal-length prefills only"))
  return rows


# -- part formats -----------------------------------------------------------------------------
def _reads_directly(spec) -> bool:
  """Whether the Mosaic GPU ragged kernel can read ``spec``'s pages as stored (bf16: its
  plain pages, as the other columns)."""
  from pallas_kernels.mosaic_gpu import ragged_attention as RA   # noqa: PLC0415
  return spec.codec.is_plain or RA.direct_reason(spec, jnp.bfloat16) is None


def run_formats(smoke: bool) -> list:
  """Every cache format, causal S x L prefill, Triton ragged kernel and auto."""
  rng = np.random.default_rng(2)
  timing = P.SMOKE_TIMING if smoke else P.TIMING
  s, L = (1, 64) if smoke else (4, 4096)
  ql, cl = [L] * s, [0] * s
  flops = P.attention_flops(ql, cl)
  rows = []
  for cd in P.FORMATS:
    spec = P.format_spec(cd)
    args = P.paged_batch(rng, spec, ql, cl)
    pick = P.auto_choice(spec, args[0], args[3], args[4], L).name
    for column, impl in (("Triton ragged", "pallas"), ("auto", "auto")):
      extra = dict(pick=pick) if impl == "auto" else {}
      record(rows, "formats", f"{s}x{L} {cd} {spec.layout}", column, flops,
             P.measure(P.kvjax_thunk(spec, impl, args, L, timing)), format=cd,
             layout=spec.layout, **extra)
    for column, read in READ_COLUMNS:
      with P.ragged_read(read):
        result = (P.measure(P.kvjax_thunk(spec, "mosaic_gpu", args, L, timing))
                  if read == "copy" or _reads_directly(spec) else
                  dict(skipped="read through the plain copy"))
      record(rows, "formats", f"{s}x{L} {cd} {spec.layout}", column, flops, result, format=cd,
             layout=spec.layout)
    del args
  return rows


# -- report -----------------------------------------------------------------------------------
def cell(row) -> str:
  if row is None:
    return "missing"
  if "ms" in row:
    return f"{row['tflops']:.0f} ({row['ms']:.2f})"
  return "skipped" if "skipped" in row else "FAILED"


def notes(rows) -> list:
  """One line per distinct reason of a skipped or failed cell, with its columns and rows."""
  seen = {}
  for r in rows:
    why = r.get("skipped") or r.get("error")
    if why:
      cols, probs = seen.setdefault(why, ({}, {}))
      cols[r["column"]] = probs[r["problem"]] = None
  return [f"- {', '.join(cols)} on {', '.join(probs)}: {why}"
          for why, (cols, probs) in seen.items()]


def check_lines(rows) -> list:
  lines = ["## Correctness (compiled, vs impl=\"reference\"; NaN in unwritten slots)", "",
           "| mix | impl | max err / ref max | rel L2 | padding rows 0 | result |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    if "skipped" in r:
      lines.append(f"| {r['name']} | {r['impl']} | - | - | - | skipped: {r['skipped']} |")
    elif "error" in r:
      lines.append(f"| {r['name']} | {r['impl']} | - | - | - | FAIL: {r['error'][:120]} |")
    else:
      lines.append(f"| {r['name']} | {r['impl']} | {r['max_err']:.2e} / {r['ref_max']:.2f} | "
                   f"{r['rel_err']:.2e} | {r['padding_zero']} | {'OK' if r['ok'] else 'FAIL'} |")
  return lines


def table_lines(rows, layout) -> list:
  problems = list(dict.fromkeys(r["problem"] for r in rows))
  columns = list(dict.fromkeys(r["column"] for r in rows))
  picks = {r["problem"]: r["pick"] for r in rows if "pick" in r}
  lines = [f"## Prefill, TFLOP/s (ms): bf16 Hq {P.HQ} H {P.H} D {P.D}, kvjax paged {layout} "
           f"block {P.N}", "",
           "| problem | " + " | ".join(columns) + " | auto picks |",
           "|---|" + "---|" * (len(columns) + 1)]
  for p in problems:
    by_col = {r["column"]: r for r in rows if r["problem"] == p}
    lines.append(f"| {p} | " + " | ".join(cell(by_col.get(c)) for c in columns) +
                 f" | {picks.get(p, '?')} |")
  return lines + [""] + mix_lines(rows) + notes(rows)


def mix_lines(rows) -> list:
  """Per column: the serving mix's time against its parts' run one after the other."""
  mix, parts = P.MIX_PARTS
  ms = {(r["problem"], r["column"]): r["ms"] for r in rows if "ms" in r}
  out = []
  for c in dict.fromkeys(r["column"] for r in rows):
    if (mix, c) in ms and all((p, c) in ms for p in parts):
      total = sum(ms[(p, c)] for p in parts)
      out.append(f"- {c}: the mix {ms[(mix, c)]:.3f} ms, its parts one after the other "
                 f"{total:.3f} ms ({ms[(mix, c)] / total:.2f}x)")
  return out


def format_lines(rows, smoke=False) -> list:
  columns = list(dict.fromkeys(r["column"] for r in rows))
  formats = list(dict.fromkeys((r["format"], r["layout"]) for r in rows))
  base = {c: next((r for r in rows if r["column"] == c and r["format"] == P.FORMATS[0]
                   and "ms" in r), None) for c in columns}
  problem = rows[0]["problem"].split()[0] if rows else "?"
  lines = [f"## Per cache format, {problem} causal prefill: TFLOP/s (ms), % of the bf16 cache's",
           "", "| format | layout | " + " | ".join(f"{c} | % bf16" for c in columns) +
           " | auto picks |", "|---|---|" + "---|---|" * len(columns) + "---|"]
  short = []
  for cd, layout in formats:
    cells, pick = [], "?"
    for c in columns:
      r = next((r for r in rows if r["column"] == c and r["format"] == cd), None)
      pick = r.get("pick", pick) if r else pick
      pct = "-"
      if r is not None and "ms" in r and base[c] is not None:
        frac = r["tflops"] / base[c]["tflops"]
        pct = f"{100 * frac:.0f} %"
        if frac < FORMAT_TARGET:
          short.append(f"{cd} ({c})")
      cells += [cell(r), pct]
    label = "bfloat16 (= auto)" if cd == "bfloat16" else cd
    lines.append(f"| {label} | {layout} | " + " | ".join(cells) + f" | {pick} |")
  if not smoke:
    verdict = "met by every measured format" if not short else "missed by " + ", ".join(short)
    lines += ["", f"Target >= {FORMAT_TARGET:.0%} of bf16: {verdict}"]
  return lines + notes(rows)


def report(result, layout) -> list:
  parts = result["parts"]
  lines = [f"# Prefill benchmark (bench_prefill.py), {result['date']}", "",
           f"- command: `{result['command']}`", f"- device: {result['device']}",
           f"- versions: {json.dumps(result['versions'])}", ""]
  if result["smoke"]:
    lines[-1:] = ["- smoke run: tiny problems, kernels in interpret mode; its timings mean "
                  "nothing", ""]
  if "checks" in parts:
    lines += check_lines(parts["checks"]) + [""]
  if "table" in parts:
    lines += table_lines(parts["table"], layout) + [""]
  if "formats" in parts:
    lines += format_lines(parts["formats"], result["smoke"]) + [""]
  return lines


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--smoke", action="store_true", help="tiny CPU interpret-mode run")
  ap.add_argument("--parts", default="checks,table,formats",
                  help=f"comma-separated parts among {','.join(PARTS)}")
  ap.add_argument("--layout", default="NHD", choices=("NHD", "HND"),
                  help="cache layout of the table's kvjax columns")
  ap.add_argument("--json", default=None,
                  help="JSON output (default $OUT/prefill.json when $OUT is set)")
  ap.add_argument("--md", default=None,
                  help="markdown report (default $OUT/prefill.md when $OUT is set)")
  args = ap.parse_args()
  parts = [p for p in args.parts.split(",") if p]
  bad = [p for p in parts if p not in PARTS]
  if bad:
    ap.error(f"--parts: unknown {bad}; choose among {PARTS}")
  if args.smoke:
    common.announce_smoke(jax.default_backend())
  json_path = common.output_path(args.json, "prefill.json")
  md_path = common.output_path(args.md, "prefill.md")
  t0 = time.time()
  result = dict(date=common.now_utc(), command=common.command_line(),
                versions=common.versions(), device=common.device_name(), smoke=args.smoke,
                parts={}, seconds={})
  say(f"versions: {result['versions']}, device: {result['device']}")
  runners = dict(checks=lambda: run_checks(args.smoke),
                 table=lambda: run_table(args.smoke, args.layout),
                 formats=lambda: run_formats(args.smoke))
  for part in PARTS:
    if part not in parts:
      continue
    t_part = time.time()
    result["parts"][part] = runners[part]()
    result["seconds"][part] = round(time.time() - t_part, 1)
    say(f"== part {part}: {result['seconds'][part]:.0f} s")
    if json_path:
      with open(json_path, "w") as fh:
        json.dump(result, fh, indent=1)
  lines = report(result, args.layout)
  say("\n" + "\n".join(lines))
  chk = result["parts"].get("checks", [])
  if chk:
    say("checks: " + ("all OK" if all(r.get("ok") for r in chk if "skipped" not in r)
                      else "FAILURES"))
  say(f"total {time.time() - t0:.0f} s")
  if md_path:
    with open(md_path, "w") as fh:
      fh.write("\n".join(lines) + "\n")
    say(f"wrote {md_path}")
  if json_path:
    say(f"wrote {json_path}")


if __name__ == "__main__":
  main()
