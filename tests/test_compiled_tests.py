"""tests/compiled_groups.py: its pytest command and its counts of a run's outcomes, on a
stand-in test file run for real (with and without xdist, finished and stopped early)."""
import os
import re
import subprocess

import pytest

import compiled_groups as ct

_TESTS = """
import time
import pytest

def test_ok():
  pass

@pytest.mark.parametrize("i", [0, 1])
def test_fails(i):
  assert i == 0

def test_skips():
  pytest.skip("here")

@pytest.mark.xfail(reason="known", strict=False)
def test_xfails():
  assert False

def test_slow_last():
  time.sleep(SLEEP)
"""


@pytest.mark.parametrize("workers", [1, 2])
def test_counts_every_outcome_once(tmp_path, workers):
  path = tmp_path / "test_standin.py"
  path.write_text(_TESTS.replace("SLEEP", "0"))
  cmd = ct.command([str(path)], workers, with_interpret=False)
  assert "(slow or not slow) and not mosaic_interpret" in cmd
  out = subprocess.run(cmd, cwd=ct.ROOT, capture_output=True, text=True, timeout=120)
  counts = ct.count(out.stdout + out.stderr)
  assert counts == dict(passed=3, failed=1, error=0, skipped=1, xfailed=1, xpassed=0), out.stdout
  line = ct.summary("g", counts, 3.2, False, 60)
  assert line == "g: 3 passed, 1 failed, 1 skipped, 1 xfailed (3 s)"


def test_a_group_stopped_by_its_limit_keeps_what_finished(tmp_path, monkeypatch, capsys):
  path = tmp_path / "test_standin.py"
  path.write_text(_TESTS.replace("SLEEP", "60"))
  monkeypatch.setitem(ct.GROUPS, "standin", [str(path)])
  counts, stopped = ct.run_group("standin", [str(path)], limit_s=12, workers=1,
                                 with_interpret=False, log_dir=str(tmp_path))
  assert stopped and counts["passed"] == 2 and counts["failed"] == 1
  assert "stopped at its 12 s limit" in capsys.readouterr().out
  assert (tmp_path / "compiled_standin.log").read_text()


def test_every_module_with_a_compiled_mode_is_in_a_group():
  """A test module that picks its mode from ``op_suite`` (interpret on CPU, compiled with
  ``KVJAX_TEST_COMPILED=1``) runs on the GPU only if a group names it."""
  tests = os.path.join(ct.ROOT, "tests")
  grouped = {os.path.basename(f) for files in ct.GROUPS.values() for f in files}
  uses_mode = re.compile(r"\b(run_mode|triton_interpret|mosaic_gpu_numerics)\(")
  modal = set()
  for name in os.listdir(tests):
    if name.startswith("test_") and name.endswith(".py"):
      with open(os.path.join(tests, name)) as f:
        if uses_mode.search(f.read()):
          modal.add(name)
  assert modal and modal <= grouped, sorted(modal - grouped)
