"""Every example script and the layout-tour notebook run to completion on CPU.

Scripts run as subprocesses (CPU, timeout) from the repository root; each known
script's report lines are checked, others must exit 0. The notebook runs with
nbclient on the ``python3`` kernel.
"""
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from xla_cpu import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SCRIPT_TIMEOUT_S = 240
NOTEBOOK = EXAMPLES / "layout_tour.ipynb"

SLOW = pytest.mark.slow

# Extra argument sets per script (each runs once per entry); scripts not listed run once bare.
# Every run is a fresh process (~6 s of CPU to import jax and torch): the fast tier runs each
# script bare (and the quick start once more with its other options at once); the other
# option sets run in the slow tier.
ARGS = {
    "quickstart.py": [[], ["--layout", "HND", "--cache-dtype", "nvfp4", "--impl", "pallas",
                           "--repeats", "1"],         # nvfp4 through the Pallas kernels (interpret)
                      pytest.param(["--layout", "HND", "--cache-dtype", "nvfp4", "--repeats", "1"],
                                   marks=SLOW),
                      pytest.param(["--impl", "pallas", "--repeats", "1"], marks=SLOW)] +
                     [pytest.param(["--cache-dtype", d, "--repeats", "1"], marks=SLOW)
                      for d in ("fp8", "fp8_e5m2", "int8_per_token_head", "fp8_per_token_head",
                                "int4_per_token_head")],
    "torch_interop.py": [[], pytest.param(["--layout", "HND", "--cache-dtype",
                                            "int8_per_token_head"], marks=SLOW),
                         pytest.param(["--cache-dtype", "fp8"], marks=SLOW)],
    "serve.py": [],   # run with its own checks in tests/test_serve_example.py
}


def _cases():
  cases = []
  for script in sorted(EXAMPLES.glob("*.py")):
    for args in ARGS.get(script.name, [[]]):
      marks = getattr(args, "marks", ())
      args = list(getattr(args, "values", (args,))[0])
      cases.append(pytest.param(script, args, id=" ".join([script.stem] + args), marks=marks))
  return cases


def _env():
  path = os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
  return subprocess_env(PYTHONUNBUFFERED="1", PYTHONPATH=path)


def _run(script, args):
  if script.name == "torch_interop.py":
    args = list(args) + ["--device", "cpu"]   # JAX runs on CPU here even where CUDA exists
  proc = subprocess.run([sys.executable, str(script)] + list(args), cwd=ROOT, env=_env(),
                        capture_output=True, text=True, timeout=SCRIPT_TIMEOUT_S)
  assert proc.returncode == 0, (f"{script.name} {args} exited {proc.returncode}\n"
                                f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n"
                                f"{proc.stderr[-4000:]}")
  return proc.stdout


def _field(out, name):
  m = re.search(rf"^\s*{re.escape(name)}\s*:\s*(.+)$", out, re.M)
  assert m, f"report line {name!r} missing in:\n{out}"
  return m.group(1).strip()


def _torch_bridge_has(name):
  try:
    import torch_bridge
  except ImportError:
    return False
  return hasattr(torch_bridge, name)


def check_quickstart(out, args):
  for i in range(1, 6):
    assert f"[{i}/5]" in out, f"progress line [{i}/5] missing"
  assert "kvjax quickstart report" in out
  assert _field(out, "backend / device").startswith("cpu")
  # every error is printed with the tolerance it is judged by, and the verdict
  errors = {}
  for name in ("attention vs reference", "max error vs dense attention"):
    line = _field(out, name)
    err, tol = float(line.split()[0]), float(re.search(r"tolerance ([\d.e+-]+)", line).group(1))
    assert err <= tol and line.endswith(": ok"), line
    errors[name] = tol
  assert errors["attention vs reference"] <= 2e-2 * 4
  cache_dtype = args[args.index("--cache-dtype") + 1] if "--cache-dtype" in args else "auto"
  # bf16 rounding only for a plain cache; quantization error for the others (nvfp4 is 4-bit)
  assert errors["max error vs dense attention"] <= {"auto": 2e-2}.get(cache_dtype, 0.6)
  assert _field(out, "padding rows zero") == "yes"
  # the report names what ran: on CPU auto takes the compiled XLA attention, and the check
  # against the reference is of that implementation
  ran = "pallas (interpret mode)" if "pallas" in args else "xla (compiled)"
  assert f"attention: {ran}" in _field(out, "impl")
  assert f"of {ran}," in _field(out, "attention vs reference")
  if _torch_bridge_has("to_torch"):
    assert _field(out, "torch bytes equal") == "yes"
    _field(out, "pointer shared")
  assert out.rstrip().splitlines()[-1] == "OK"


def check_torch_interop(out, args):
  if not _torch_bridge_has("PagedAttentionBackend"):
    assert "torch_bridge facade not available" in out
    return
  assert "torch interop report" in out
  assert _field(out, "cache data_ptr unchanged") == "yes"
  assert _field(out, "output written in place") == "yes"
  dense = _field(out, "max error vs SDPA on original K/V")
  err, tol = float(dense.split()[0]), float(re.search(r"tolerance (\S+)\)", dense).group(1))
  assert err < tol <= (2e-2 if "--cache-dtype" not in args else 0.25)
  paged = _field(out, "max error vs SDPA on paged K/V")   # int8 and fp8 read through views
  assert float(paged.split()[0]) < 2e-2
  assert _field(out, "JAX buffer pointer == torch pointer") == "yes"
  assert out.rstrip().splitlines()[-1] == "OK"


CHECKS = {"quickstart.py": check_quickstart, "torch_interop.py": check_torch_interop}


@pytest.mark.parametrize("script,args", _cases())
def test_example_script_runs(script, args):
  out = _run(script, args)
  check = CHECKS.get(script.name)
  if check is not None:
    check(out, args)


def test_quickstart_rejects_bad_flags():
  proc = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py"), "--layout", "XYZ"],
                        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_notebook_is_committed_without_outputs():
  nb = json.loads(NOTEBOOK.read_text())        # plain JSON: nbformat costs seconds to import
  assert nb["nbformat"] == 4
  code = [c for c in nb["cells"] if c["cell_type"] == "code"]
  assert code and all(not c["outputs"] and c["execution_count"] is None for c in code)
  assert NOTEBOOK.stat().st_size < 40_000


def test_notebook_executes(monkeypatch):
  nbformat = pytest.importorskip("nbformat")
  nbclient = pytest.importorskip("nbclient")
  pytest.importorskip("ipykernel")
  for k, v in _env().items():
    monkeypatch.setenv(k, v)
  nb = nbformat.read(str(NOTEBOOK), as_version=4)
  client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=150,
                                   resources={"metadata": {"path": str(ROOT)}})
  client.execute()
  text, images = [], 0
  for cell in nb.cells:
    for o in cell.get("outputs", []):
      assert o.output_type != "error", f"{o.get('ename')}: {o.get('evalue')}"
      if o.output_type == "stream":
        text.append(o.text)
      elif "image/png" in o.get("data", {}):
        images += 1
  text = "".join(text)
  # the contract's worked numbers (docs/layout.md §3, §5)
  assert "strides (32768, 2048, 256, 1)" in text and "strides (32768, 256, 4096, 1)" in text
  assert "(2112, 132, 66) float32 offsets 32 65" in text
  assert "@ 8192" in text and "@ 9216" in text
  err = float(re.search(r"max \|Pallas - reference\| = (\S+)", text).group(1))
  assert err < 2e-2
  assert images >= 1
