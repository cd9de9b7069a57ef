"""One benchmark on two source trees in turn, in one job on one GPU: the A/B of a code change.

Jobs on the same kind of GPU differ by up to a third in their timings (the same writer took
23.6 µs in one job and 32.3 µs in another), more than many changes move. So a change is
judged by running the benchmark on the tree before it ("base") and the tree after it ("head")
alternately, for several rounds in the same job, and comparing the best time of each.

Prepare the base tree where git is (it is a plain copy of the files: carry ``.ab`` to a
machine without git)::

    python benchmarks/tools/ab.py prepare --rev HEAD~1             # -> .ab/base (git-ignored)

(``--out .ab/NAME`` extracts another revision; ``run --head .ab/NAME --head .ab/OTHER`` times
several trees against the base in the same rounds.)

Then, on the GPU::

    python3 benchmarks/tools/ab.py run --rounds 2 -- benchmarks/bench_write.py --parts formats \\
        --formats nvfp4 --no-vllm

``run`` starts ``python <script> <args> --json FILE`` with each tree as working directory and
first on ``PYTHONPATH`` (base, then head, every round), reads the ``rows`` of each JSON
(``bench_write.py``, ``bench_decode.py``, ``bench_prefill.py`` and ``tools/sweep_decode.py``
write them) and prints, per row matched on its key fields, each tree's best ``us`` over the
rounds and head / base, after every round (and into ``--json`` each time), so a job's time
limit keeps what it timed.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_BASE = os.path.join(ROOT, ".ab", "base")
#: Row fields that name a row (those present are used), and the measured field.
KEY_FIELDS = ("kernel", "cache_dtype", "layout", "variant", "batch", "context", "impl",
              "problem", "part", "column")
VALUE_FIELD = "us"


def prepare(rev: str, out: str = DEFAULT_BASE, repo: str = ROOT) -> str:
  """Extract the tracked files of ``rev`` into ``out`` (replaced), without pictures and the raw
  benchmark outputs older revisions kept in git (so the copy stays small enough to carry).
  Returns the commit it resolved to."""
  commit = subprocess.run(["git", "rev-parse", rev], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()
  shutil.rmtree(out, ignore_errors=True)
  os.makedirs(out)
  archive = subprocess.run(["git", "archive", commit], cwd=repo, check=True,
                           capture_output=True).stdout
  subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
  for heavy in ("benchmarks/results", "docs/img"):
    shutil.rmtree(os.path.join(out, heavy), ignore_errors=True)
  with open(os.path.join(out, "AB_REV"), "w") as f:
    f.write(commit + "\n")
  return commit


def _env(tree: str) -> dict:
  """The environment of a run in ``tree``: the tree first on PYTHONPATH, the caller's entries
  (made absolute) after it."""
  env = dict(os.environ)
  rest = [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
  env["PYTHONPATH"] = os.pathsep.join([tree] + rest)
  return env


def check_imports(tree: str):
  """Fail unless Python started in ``tree`` imports that tree's packages (an installed copy
  found first would make both runs the same code)."""
  probe = ("import os, kvjax, pallas_kernels; "
           "print(os.path.dirname(os.path.dirname(os.path.abspath(kvjax.__file__))), "
           "os.path.dirname(os.path.dirname(os.path.abspath(pallas_kernels.__file__))))")
  done = subprocess.run([sys.executable, "-c", probe], cwd=tree, env=_env(tree),
                        capture_output=True, text=True)
  if done.returncode:
    last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
    raise SystemExit(f"Python started in {tree} cannot import kvjax / pallas_kernels: {last}")
  found = done.stdout.split()
  if any(os.path.realpath(p) != os.path.realpath(tree) for p in found):
    raise SystemExit(f"Python started in {tree} imports kvjax / pallas_kernels from {found}")


def run_once(tree: str, script: str, args: list, json_path: str) -> list:
  """Run ``script`` (a path relative to the tree) in ``tree``; its JSON rows."""
  cmd = [sys.executable, script, *args, "--json", json_path]
  done = subprocess.run(cmd, cwd=tree, env=_env(tree))
  if done.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed in {tree} (exit {done.returncode}); the options "
                     "given must exist in both trees")
  with open(json_path) as f:
    return timed_rows(json.load(f))


def timed_rows(data: dict) -> list:
  """A benchmark JSON's rows: its ``rows``, or the rows of each of its ``parts``
  (``bench_prefill.py``); a row timed in ``ms`` only gets its ``us``."""
  rows = data.get("rows")
  if rows is None:
    rows = [r for part in data.get("parts", {}).values() if isinstance(part, list)
            for r in part]
  return [dict(r, us=r["ms"] * 1e3) if "us" not in r and "ms" in r else r for r in rows]


def row_key(row: dict) -> tuple:
  return tuple((k, row[k]) for k in KEY_FIELDS if k in row)


def compare(results: dict) -> list:
  """``results``: tree name -> list (one per round) of row lists, with the tree "base" and
  one or more head trees. Returns one dict per (head tree, key) present in the head and the
  base: the key, the head tree's name, each tree's values per round and best, head / base."""
  values = {}
  for tree, rounds in results.items():
    for rows in rounds:
      for row in rows:
        if row.get(VALUE_FIELD) is not None:
          values.setdefault(row_key(row), {}).setdefault(tree, []).append(row[VALUE_FIELD])
  table = []
  for tree in (t for t in results if t != "base"):
    for key, per_tree in values.items():
      if "base" in per_tree and tree in per_tree:
        base_best, head_best = min(per_tree["base"]), min(per_tree[tree])
        table.append(dict(key=dict(key), tree=tree, base=per_tree["base"],
                          head=per_tree[tree], base_best=base_best, head_best=head_best,
                          ratio=head_best / base_best))
  return table


def markdown(table: list, base_rev: str) -> str:
  trees = list(dict.fromkeys(r["tree"] for r in table))
  lines = [f"base = {base_rev}, head = {', '.join(trees) or 'this tree'}; {VALUE_FIELD} per "
           "round, best, head / base", "",
           "| row | head tree | base | head | best base | best head | head / base |",
           "|---|---|---|---|---|---|---|"]
  for r in table:
    name = " ".join(str(v) for v in r["key"].values())
    rounds = lambda v: " / ".join(f"{x:.1f}" for x in v)
    lines.append(f"| {name} | {r['tree']} | {rounds(r['base'])} | {rounds(r['head'])} | "
                 f"{r['base_best']:.1f} | {r['head_best']:.1f} | {r['ratio']:.3f} |")
  return "\n".join(lines)


def head_names(heads: list) -> list:
  """A name per head tree: "head" for one, else each folder's name (made unique)."""
  if len(heads) == 1:
    return ["head"]
  names = []
  for tree in heads:
    name = os.path.basename(os.path.normpath(tree))
    names.append(name if name not in names and name != "base" else f"{name}_{len(names)}")
  return names


def run(script: str, args: list, rounds: int, base: str = DEFAULT_BASE, head=ROOT,
        check: bool = True, on_round=None):
  """Alternate the base tree and the head tree(s) (``head``: a path or a list of paths) for
  ``rounds`` rounds; returns (table, base revision). ``check``: first make sure each tree
  imports its own packages (:func:`check_imports`). ``on_round(table, base_rev, done)``:
  called after each round with the comparison so far (a job stopped by a time limit keeps
  what it measured)."""
  heads = [head] if isinstance(head, str) else list(head)
  if not os.path.isdir(base):
    raise SystemExit(f"base tree {base!r} is missing: run `python benchmarks/tools/ab.py prepare "
                     "--rev REV` first (where git is) and carry it")
  rev_file = os.path.join(base, "AB_REV")
  base_rev = open(rev_file).read().strip() if os.path.exists(rev_file) else base
  for tree in [base, *heads] if check else ():
    check_imports(tree)
  trees = [("base", base), *zip(head_names(heads), heads)]
  results = {name: [] for name, _ in trees}
  with tempfile.TemporaryDirectory() as tmp:
    for r in range(rounds):
      for name, tree in trees:
        print(f"== round {r + 1}/{rounds}: {name} ({tree})", flush=True)
        results[name].append(run_once(tree, script, args,
                                      os.path.join(tmp, f"{name}_{r}.json")))
      if on_round is not None:
        on_round(compare(results), base_rev, r + 1)
  return compare(results), base_rev


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = ap.add_subparsers(dest="cmd", required=True)
  p = sub.add_parser("prepare", help="extract the base tree (needs git)")
  p.add_argument("--rev", required=True)
  p.add_argument("--out", default=DEFAULT_BASE)
  r = sub.add_parser("run", help="alternate base and head: run -- SCRIPT [ARGS ...]")
  r.add_argument("--rounds", type=int, default=2)
  r.add_argument("--base", default=DEFAULT_BASE)
  r.add_argument("--head", action="append", default=None,
                 help="a head tree (default: this one); repeat to time several against the base")
  r.add_argument("--json", default=None, help="write the comparison here")
  r.add_argument("command", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS ...]")
  args = ap.parse_args()
  if args.cmd == "prepare":
    print(f"{args.out}: {prepare(args.rev, args.out)}")
    return
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    ap.error("run needs -- SCRIPT [ARGS ...]")
  def report(table, base_rev, done):
    print(f"== after round {done}/{args.rounds}", flush=True)
    print(markdown(table, base_rev), flush=True)
    if args.json:
      with open(args.json, "w") as f:
        json.dump(dict(base=base_rev, command=command, rounds=done, rows=table), f, indent=1)

  run(command[0], command[1:], args.rounds, os.path.abspath(args.base),
      [os.path.abspath(h) for h in args.head or [ROOT]], on_round=report)


if __name__ == "__main__":
  main()
