"""The benchmarks' ``--smoke`` runs on CPU: each runs, says first that its timings mean nothing,
gives no verdict on them, and writes no file unless asked (``--json`` / ``$OUT``).

bench_prefill.py's smoke run is tests/test_bench_prefill.py's."""
import json
import os
import subprocess
import sys

import pytest

from xla_cpu import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW = pytest.mark.slow


def _smoke(tmp_path, script, *args):
  """Run ``benchmarks/<script> --smoke`` in an empty folder, ``$OUT`` unset: its stdout."""
  env = subprocess_env(PYTHONPATH=ROOT)
  env.pop("OUT", None)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--smoke",
                         *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
  assert proc.stdout.startswith("smoke run on cpu: "), proc.stdout[:300]
  assert "timings mean nothing" in proc.stdout.splitlines()[0]
  return proc.stdout


@pytest.mark.parametrize("script", [
    "bench_facade.py",
    pytest.param("bench_decode.py", marks=SLOW),
    pytest.param("bench_write.py", marks=SLOW),
    pytest.param("bench_side_by_side.py", marks=SLOW)])
def test_smoke_run_says_what_its_numbers_are_worth(tmp_path, script):
  out = _smoke(tmp_path, script)
  for verdict in ("GPU-bound", "host-bound", "Target", "target"):
    assert verdict not in out, f"{script} --smoke prints {verdict!r}"
  assert not os.listdir(tmp_path), f"{script} --smoke wrote {os.listdir(tmp_path)}"


def test_smoke_run_writes_where_asked(tmp_path):
  """Also a quantized format's caches (filled through the facade's writes): the facade's and
  the floor loop's results equal the direct call's."""
  out = _smoke(tmp_path, "bench_facade.py", "--json", "facade.json", "--cache-dtype",
               "fp8_per_token_head")
  assert os.listdir(tmp_path) == ["facade.json"]
  assert "cache_dtype 'fp8_per_token_head'" in out
  with open(tmp_path / "facade.json") as f:
    rows = json.load(f)["rows"]
  assert len(rows) == 2
  for row in rows:
    assert row["max_abs_diff"] == row["jax_max_abs_diff"] == row["floor_max_abs_diff"] == 0
