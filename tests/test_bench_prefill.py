"""benchmarks/bench_prefill.py and its shared pieces (benchmarks/prefill_peers.py) on CPU: the
FLOP count against the causal mask, the problem builder against the reference reader, the smoke
checks (Triton kernel in interpret mode vs the reference), and the whole smoke run's report."""
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from benchmarks import bench_prefill
from benchmarks import prefill_peers as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_visible_pairs_count_the_causal_mask(rng):
  q_lens = rng.integers(0, 40, 6)
  ctx_lens = rng.integers(0, 90, 6)
  mask_pairs = sum(int(np.sum(np.tril(np.ones((q, c + q), bool), k=c))) for q, c in
                   zip(q_lens, ctx_lens))
  assert P.visible_pairs(q_lens, ctx_lens) == mask_pairs
  assert P.attention_flops(q_lens, ctx_lens, hq=6, d=16) == 4 * 6 * 16 * mask_pairs


def test_mix_line_sets_the_mix_against_its_parts():
  """The table's mix line: per column with the mix and both parts timed, mix / sum of parts;
  a column missing a part gets no line."""
  mix, (a, b) = P.MIX_PARTS
  assert {mix, a, b} <= {p for p, _, _ in P.PROBLEMS}
  rows = [dict(problem=mix, column="x", ms=0.6), dict(problem=a, column="x", ms=0.25),
          dict(problem=b, column="x", ms=0.15), dict(problem=mix, column="y", ms=0.5),
          dict(problem=a, column="y", ms=0.2), dict(problem=b, column="y", skipped="why")]
  assert bench_prefill.mix_lines(rows) == [
      "- x: the mix 0.600 ms, its parts one after the other 0.400 ms (1.50x)"]


@pytest.mark.parametrize("cache_dtype", ["auto", "int8_per_token_head"])
def test_paged_batch_writes_every_token_into_its_page(rng, cache_dtype):
  """fill="nan": every page a sequence names is written, the others keep their NaN bytes;
  fill="random": finite codes and scales (the reference attends to finite values)."""
  spec = kvjax.KVCacheSpec(2, 64, 16, cache_dtype, dtype=jnp.bfloat16)
  q_lens, ctx_lens = [20, 1, 0], [0, 40, 17]
  q, cache, qsl, sl, bt = P.paged_batch(rng, spec, q_lens, ctx_lens, hq=4, pad=3, fill="nan")
  assert q.shape == (sum(q_lens) + 3, 4, 64)
  assert np.asarray(qsl).tolist() == [0, 20, 21, 21]
  assert np.asarray(sl).tolist() == [20, 41, 17]
  raw = np.asarray(cache).view(np.uint8).reshape(cache.shape[0], -1)
  used = {int(p) for s, L in enumerate(np.asarray(sl)) for p in np.asarray(bt)[s, :-(-L // 16)]}
  assert len(used) == sum(-(-int(L) // 16) for L in np.asarray(sl))    # distinct pages
  for page in set(range(cache.shape[0])) - used:
    assert np.all(raw[page] == 0xFF)
  for page in used:
    assert not np.all(raw[page] == 0xFF)
  rand = P.paged_batch(rng, spec, q_lens, ctx_lens, hq=4)
  out = np.asarray(P.kvjax_fn(spec, "reference", max(q_lens))(*rand), np.float32)
  assert np.isfinite(out).all() and np.abs(out[:sum(q_lens)]).max() > 0


def test_smoke_checks_pass():
  """The Triton kernel (interpret mode) matches the reference on the smoke mix; the Mosaic GPU
  row is measured or skipped with the registry's reason."""
  rows = bench_prefill.run_checks(smoke=True)
  by_impl = {r["impl"]: r for r in rows}
  triton = by_impl["pallas"]
  assert triton["ok"] and triton["padding_zero"] and triton["finite"]
  assert triton["max_err"] <= P.CHECK_TOL * triton["ref_max"]
  mosaic = by_impl["mosaic_gpu"]
  assert mosaic.get("ok") or mosaic["skipped"]


def test_compare_catches_a_wrong_row_and_dirty_padding(rng):
  ref = rng.standard_normal((10, 2, 8)).astype(np.float32)
  ref[8:] = 0
  assert P.compare(ref, ref, 8)["ok"]
  bad = ref.copy()
  bad[3, 1] += 0.5
  assert not P.compare(bad, ref, 8)["ok"]
  dirty = ref.copy()
  dirty[9, 0, 0] = 1e-3
  out = P.compare(dirty, ref, 8)
  assert not out["ok"] and not out["padding_zero"]


@pytest.mark.slow
def test_smoke_run_reports_every_part(tmp_path):
  """``--smoke`` end to end: the JSON holds the checks, every problem x column of the table
  (auto's pick named) and every cache format in both columns."""
  path = tmp_path / "prefill.json"
  env = dict(os.environ, PYTHONPATH=ROOT)
  env.pop("OUT", None)
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_prefill.py"),
                         "--smoke", "--json", str(path)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "checks: all OK" in proc.stdout
  parts = json.loads(path.read_text())["parts"]
  table = parts["table"]
  columns = {r["column"] for r in table}
  assert columns == {c for c, _ in bench_prefill.KVJAX_COLUMNS} | set(P.DENSE_PEERS)
  assert {r["problem"] for r in table} == {p for p, _, _ in P.SMOKE_PROBLEMS}
  assert all(r["pick"] for r in table if r["column"] == "kvjax auto (paged)")
  triton = [r for r in table if r["column"] == "kvjax Triton (paged)"]
  assert all(r["ms"] > 0 for r in triton)
  formats = parts["formats"]
  assert sorted({r["format"] for r in formats}) == sorted(P.FORMATS)
  assert all("ms" in r for r in formats)
  assert proc.stdout.startswith("smoke run on cpu: ")
  assert "Target" not in proc.stdout          # no verdict on a smoke run's timings
