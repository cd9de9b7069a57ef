"""benchmarks/tools/ab.py: the base tree's extraction and the alternation of two trees, on CPU with a
stand-in benchmark script (no GPU, no kernels)."""
import json
import os
import subprocess

import pytest

from benchmarks.tools import ab

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A stand-in benchmark: its rows' times come from the tree's US file; it logs which tree ran
# and what came first on PYTHONPATH.
_SCRIPT = """
import json, os, sys
args = sys.argv[1:]
out = args[args.index("--json") + 1]
us = float(open("US").read())
with open(os.environ["AB_LOG"], "a") as f:
  f.write(os.path.basename(os.getcwd()) + " " + os.environ["PYTHONPATH"].split(os.pathsep)[0]
          + " " + " ".join(a for a in args if a.startswith("--fmt")) + "\\n")
rows = [dict(cache_dtype="nvfp4", layout="HND", us=us), dict(cache_dtype="fp8", layout="NHD",
        us=2 * us), dict(cache_dtype="only_here", layout=os.path.basename(os.getcwd()), us=1.0)]
json.dump(dict(rows=rows), open(out, "w"))
"""


def _tree(path, us):
  os.makedirs(path / "b")
  (path / "b" / "bench.py").write_text(_SCRIPT)
  (path / "US").write_text(str(us))
  return str(path)


def test_run_alternates_the_trees_and_compares_matching_rows(tmp_path, monkeypatch):
  base, head = _tree(tmp_path / "base", 40.0), _tree(tmp_path / "head", 30.0)
  log = tmp_path / "log"
  monkeypatch.setenv("AB_LOG", str(log))
  reports = []
  table, rev = ab.run("b/bench.py", ["--fmt=x"], rounds=2, base=base, head=head, check=False,
                      on_round=lambda t, r, done: reports.append((len(t), r, done)))
  assert reports == [(2, base, 1), (2, base, 2)]             # the comparison after each round
  runs = [line.split() for line in log.read_text().splitlines()]
  assert [r[0] for r in runs] == ["base", "head", "base", "head"]
  assert all(r[1] == os.path.join(str(tmp_path), r[0]) for r in runs)   # the tree comes first
  assert all(r[2] == "--fmt=x" for r in runs)
  assert rev == base                                          # no AB_REV file: the folder
  by_dtype = {r["key"]["cache_dtype"]: r for r in table}
  assert set(by_dtype) == {"nvfp4", "fp8"}                     # rows of one tree only: left out
  assert by_dtype["nvfp4"]["base"] == [40.0, 40.0] and by_dtype["nvfp4"]["head_best"] == 30.0
  assert by_dtype["fp8"]["ratio"] == pytest.approx(0.75)
  assert ("| nvfp4 HND | head | 40.0 / 40.0 | 30.0 / 30.0 | 40.0 | 30.0 | 0.750 |"
          in ab.markdown(table, rev))


def test_run_times_several_head_trees_against_the_base(tmp_path, monkeypatch):
  base = _tree(tmp_path / "base", 40.0)
  fast, slow = _tree(tmp_path / "fast", 20.0), _tree(tmp_path / "slow", 80.0)
  monkeypatch.setenv("AB_LOG", str(tmp_path / "log"))
  table, _ = ab.run("b/bench.py", [], rounds=1, base=base, head=[fast, slow], check=False)
  runs = [line.split()[0] for line in (tmp_path / "log").read_text().splitlines()]
  assert runs == ["base", "fast", "slow"]
  ratio = {(r["tree"], r["key"]["cache_dtype"]): r["ratio"] for r in table}
  assert ratio == pytest.approx({("fast", "nvfp4"): 0.5, ("fast", "fp8"): 0.5,
                                 ("slow", "nvfp4"): 2.0, ("slow", "fp8"): 2.0})
  assert "| nvfp4 HND | slow | 40.0 | 80.0 | 40.0 | 80.0 | 2.000 |" in ab.markdown(table, "r")


def test_prepare_extracts_the_revision_without_results(tmp_path):
  if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
    pytest.skip("not a git checkout")
  out = str(tmp_path / "base")
  commit = ab.prepare("HEAD", out)
  head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                        text=True).stdout.strip()
  assert commit == head and open(os.path.join(out, "AB_REV")).read().strip() == head
  assert os.path.exists(os.path.join(out, "kvjax", "quant.py"))
  assert not os.path.exists(os.path.join(out, "benchmarks", "results"))
  ab.check_imports(out)                          # the extracted tree imports its own packages
  with pytest.raises(SystemExit, match="kvjax / pallas_kernels"):
    ab.check_imports(str(tmp_path))              # a folder without them does not (whether
                                                 # or not an installed copy exists)


def test_run_without_a_base_tree_says_what_to_do(tmp_path):
  with pytest.raises(SystemExit, match="prepare --rev"):
    ab.run("b/bench.py", [], rounds=1, base=str(tmp_path / "missing"), head=ROOT)


def test_compare_output_is_json_serializable():
  table = ab.compare({"base": [[dict(cache_dtype="a", layout="NHD", us=2.0)]],
                      "head": [[dict(cache_dtype="a", layout="NHD", us=1.0)]]})
  assert json.loads(json.dumps(table))[0]["ratio"] == 0.5


def test_prefill_rows_match_on_implementation_and_problem():
  """Prefill rows keyed by implementation and problem (impl, problem, us) pair up across the
  trees."""
  row = lambda impl, problem, us: dict(kind="bench", impl=impl, problem=problem, us=us)
  table = ab.compare({
      "base": [[row("Mosaic GPU NHD", "4x4096", 1100.0), row("Mosaic GPU NHD", "16x1024", 500.0),
                dict(kind="check", name="x", ok=True)]],
      "head": [[row("Mosaic GPU NHD", "4x4096", 1000.0), row("Mosaic GPU NHD", "16x1024", 450.0)]]})
  by_problem = {r["key"]["problem"]: r["ratio"] for r in table}
  assert by_problem == pytest.approx({"4x4096": 1000 / 1100, "16x1024": 0.9})


def test_sweep_rows_match_on_problem_and_configuration():
  """Sweep rows (round, problem, variant: the configuration, us) pair up per configuration."""
  row = lambda problem, config, us: dict(round=0, problem=problem, variant=config, us=us)
  table = ab.compare({
      "base": [[row("4x4096", "default", 1000.0), row("4x4096", "regs=240/24", 990.0)]],
      "head": [[row("4x4096", "default", 900.0), row("4x4096", "regs=240/24", 1089.0)]]})
  by_config = {r["key"]["variant"]: r["ratio"] for r in table}
  assert by_config == pytest.approx({"default": 0.9, "regs=240/24": 1.1})


def test_bench_prefill_parts_are_read_as_rows_timed_in_us():
  """bench_prefill.py writes its rows per part, timed in ms: each becomes a row in µs, keyed by
  its part, problem and column."""
  data = {"parts": {"formats": [dict(part="formats", problem="4x4096 int4", column="auto",
                                     ms=1.25),
                                dict(part="formats", problem="4x4096 int4", column="Triton",
                                     skipped="no GPU")],
                    "checks": [dict(name="mix", ok=True)]}}
  rows = ab.timed_rows(data)
  assert rows[0]["us"] == pytest.approx(1250.0) and "us" not in rows[1]
  table = ab.compare({"base": [rows], "head": [[dict(rows[0], us=1000.0)]]})
  assert [(r["key"]["column"], round(r["ratio"], 3)) for r in table] == [("auto", 0.8)]
