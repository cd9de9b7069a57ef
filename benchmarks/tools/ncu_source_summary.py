"""Where a kernel's warps wait, per instruction: a summary of Nsight Compute's source page.

On the GPU, profile with the source counters and export the SASS page as CSV::

    ncu -k regex:kvjax_paged_decode --launch-count 1 --clock-control none \\
        --section SourceCounters --section WarpStateStats -o prof \\
        python3 benchmarks/tools/sweep_decode.py --once --formats fp8 --variants default
    ncu -i prof.ncu-rep --page source --csv --print-source sass | gzip > src.csv.gz

Anywhere (no GPU needed)::

    python benchmarks/tools/ncu_source_summary.py src.csv.gz [--top 12]

prints the warp-stall samples by reason over the whole kernel; by *region*, the runs of
instructions executed the same number of times (a loop body, the code run once per work
item, the producer's loop: each has its own count); and, for the region with the most
samples, by opcode with each opcode's leading stall reasons.
"""
from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
_PREDICATE = re.compile(r"^@!?U?P\w+\s+")


def read_source_csv(path: str) -> list[dict]:
  """Rows of ncu's ``--page source --csv --print-source sass`` export (gzip or plain): one
  dict a SASS instruction, numbers as floats (``-`` and blanks as 0), ``Source`` as text."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt") as fh:
    lines = fh.read().splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith('"Address"'))
  rows = []
  for rec in csv.DictReader(io.StringIO("\n".join(lines[start:]))):
    row = {"Source": rec["Source"].strip(), "Address": rec["Address"]}
    for key, value in rec.items():
      if key in row or key is None:
        continue
      try:
        row[key] = float(value)
      except (TypeError, ValueError):
        row[key] = 0.0
    rows.append(row)
  return rows


def stall_reasons(rows: list[dict]) -> list[str]:
  """The per-reason sample columns (all samples, not the not-issued ones)."""
  return [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]


def opcode(source: str) -> str:
  """``@!P1 BRA 0x...`` -> ``BRA``; ``HGMMA.64x128x16.F32.BF16 R88, ...`` -> ``HGMMA...``."""
  return _PREDICATE.sub("", source).split()[0] if source else "?"


def by_reason(rows: list[dict]) -> dict[str, float]:
  return {r[len("stall_"):]: sum(row[r] for row in rows) for r in stall_reasons(rows)}


def regions(rows: list[dict]) -> list[dict]:
  """Instructions grouped by their execution count: samples, instructions, first / last
  index; the most sampled first."""
  out: dict[int, dict] = {}
  for i, row in enumerate(rows):
    reg = out.setdefault(int(row[EXECUTED]), dict(executed=int(row[EXECUTED]), samples=0.0,
                                                 instructions=0, first=i, last=i))
    reg["samples"] += row[SAMPLES]
    reg["instructions"] += 1
    reg["last"] = i
  return sorted(out.values(), key=lambda r: -r["samples"])


def by_opcode(rows: list[dict], executed: int) -> list[tuple[str, int, float, dict]]:
  """(opcode, instructions, samples, samples by reason) over the instructions executed
  ``executed`` times, the most sampled first."""
  reasons = stall_reasons(rows)
  acc: dict[str, list] = {}
  for row in rows:
    if int(row[EXECUTED]) != executed:
      continue
    entry = acc.setdefault(opcode(row["Source"]), [0, 0.0, collections.Counter()])
    entry[0] += 1
    entry[1] += row[SAMPLES]
    for r in reasons:
      entry[2][r[len("stall_"):]] += row[r]
  return sorted(((op, n, s, dict(c)) for op, (n, s, c) in acc.items()), key=lambda e: -e[2])


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("csv", help="ncu --page source --csv --print-source sass output (.gz ok)")
  ap.add_argument("--top", type=int, default=12)
  args = ap.parse_args()
  rows = read_source_csv(args.csv)
  total = sum(r[SAMPLES] for r in rows)
  print(f"{len(rows)} instructions, {total:.0f} samples, "
        f"{sum(r[EXECUTED] for r in rows):.0f} warp instructions executed")
  print("\nby stall reason:")
  for reason, s in sorted(by_reason(rows).items(), key=lambda x: -x[1])[:args.top]:
    print(f"  {reason:22s} {s:9.0f} {100 * s / total:5.1f} %")
  regs = regions(rows)
  print("\nby region (instructions executed the same number of times):")
  for reg in regs[:args.top]:
    print(f"  executed {reg['executed']:>10d}x  {reg['samples']:9.0f} samples "
          f"({100 * reg['samples'] / total:4.1f} %)  {reg['instructions']:5d} instructions, "
          f"index {reg['first']}-{reg['last']}")
  hot = regs[0]
  print(f"\nthe hottest region (executed {hot['executed']}x) by opcode:")
  for op, n, s, reasons in by_opcode(rows, hot["executed"])[:args.top]:
    lead = ", ".join(f"{k} {v:.0f}" for k, v in sorted(reasons.items(), key=lambda x: -x[1])[:3])
    print(f"  {op:32s} {n:4d} instr {s:8.0f} ({100 * s / hot['samples']:4.1f} %)  {lead}")


if __name__ == "__main__":
  main()
