"""examples/serve.py runs a continuous-batching loop on CPU and matches the dense model.

Small settings keep it fast: one layer, 4 sequences per step, two step shapes
(decode-only and one mixed bucket), few pages so requests wait for freed ones.
"""
import importlib.util
import re
import subprocess
import sys

import numpy as np
import pytest

import kvjax
from test_examples import EXAMPLES, ROOT, _env
from kv_testing import assert_step_lowers_for_cuda

SMALL = ["--requests", "6", "--steps", "1", "--max-prompt", "24", "--max-new", "4",
         "--layers", "1", "--max-seqs", "4", "--max-tokens", "16", "--chunk", "16",
         "--num-blocks", "6"]


def _serve(args, timeout=180):
  return subprocess.run([sys.executable, str(EXAMPLES / "serve.py")] + args, cwd=ROOT,
                        env=_env(), capture_output=True, text=True, timeout=timeout)


def _field(out, name):
  m = re.search(rf"^\s*{re.escape(name)}\s*:\s*(.+)$", out, re.M)
  assert m, f"report line {name!r} missing in:\n{out}"
  return m.group(1).strip()


def _run_ok(args):
  proc = _serve(args)
  assert proc.returncode == 0, (f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n"
                                f"{proc.stderr[-3000:]}")
  out = proc.stdout
  assert out.rstrip().splitlines()[-1] == "OK", out
  assert _field(out, "requests").startswith("6 finished of 6")
  assert _field(out, "all pages freed") == "yes"
  waited = int(_field(out, "waited for pages/slots").split()[0])
  assert waited > 0                        # 6 requests at step 0, 4 slots: some must wait
  shapes = int(_field(out, "compiled step shapes").split()[0])
  assert 1 <= shapes <= 2                  # decode-only (4, 1) and mixed (16, 16)
  assert float(_field(out, "throughput").split()[0]) > 0
  return out


def test_serve_pallas_interpret_matches_dense_model(rng):
  seed = str(int(rng.integers(0, 2**31)))
  out = _run_ok(SMALL + ["--impl", "pallas", "--seed", seed])
  assert _field(out, "backend / impl") == "cpu / pallas (interpret mode)"
  same, total = map(int, re.match(r"(\d+)/(\d+)", _field(out, "tokens equal to dense")).groups())
  ties = int(re.search(r"(\d+) other", _field(out, "tokens equal to dense")).group(1))
  assert total >= 6 and same + ties == total
  assert float(_field(out, "max logit error").split()[0]) < 1e-4   # float32, CPU


def test_serve_quantized_cache_reports_agreement(rng):
  seed = str(int(rng.integers(0, 2**31)))
  out = _run_ok(SMALL + ["--cache-dtype", "int8_per_token_head", "--layout", "HND",
                         "--seed", seed])
  assert _field(out, "cache").startswith("int8_per_token_head, layout HND")
  rate = float(re.search(r"^agreement rate: (\S+)", out, re.M).group(1))
  assert 0 <= rate <= 1


def test_serve_rejects_bad_flags():
  proc = _serve(["--max-tokens", "2", "--max-seqs", "4"], timeout=120)
  assert proc.returncode == 2 and "--max-tokens 2 must be >= --max-seqs 4" in proc.stderr


@pytest.fixture(scope="module")
def serve():
  """examples/serve.py imported as a module."""
  mod_spec = importlib.util.spec_from_file_location("serve_example", EXAMPLES / "serve.py")
  module = importlib.util.module_from_spec(mod_spec)
  sys.modules[mod_spec.name] = module          # its dataclasses look their module up there
  mod_spec.loader.exec_module(module)
  yield module
  del sys.modules[mod_spec.name]


def test_serve_step_lowers_for_cuda(serve):
  """The GPU path of the step (Pallas write + decode and ragged kernels) lowers for CUDA here."""
  cfg = serve.ModelConfig(layers=1)              # the example's default dtype, float32
  spec = kvjax.KVCacheSpec(num_kv_heads=cfg.num_kv_heads, head_size=cfg.head_size,
                           block_size=16, dtype=cfg.dtype)
  step, traced = serve.make_step(cfg, spec, impl="pallas", interpret=False)
  params = serve.init_params(np.random.default_rng(0), cfg)
  assert_step_lowers_for_cuda(step, traced, params, (spec.allocate(8),))
