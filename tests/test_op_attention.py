"""The attention case suite: every case on every implementation of kvjax.unified_attention.

Implementations come from ``kvjax.registry.ATTENTION`` (reference, the Triton kernels -- in
interpret mode on CPU, compiled with KVJAX_TEST_COMPILED=1 on a GPU -- and the test-only toy
backend); see op_suite.py. Each case is a ragged batch (prefills with and without a cached
prefix, decodes, an empty sequence, padding tokens) or a decode batch (one query per
sequence: the Triton decode kernel) on a poisoned cache, checked against a float64 numpy
oracle with scale-aware bounds.
"""
import dataclasses
import functools
from typing import Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from attention_cases import build_batch, numpy_attention
from kv_testing import jit_reference_write
from op_suite import (TOY_BACKEND, implementations, known_gap, run_mode,  # noqa: F401
                      toy_format)
from toy_format import TOY

RAGGED = ((6, 1, 9, 0, 1), (0, 30, 11, 5, 0), 2)   # q lens, cached prefixes, padding tokens
DECODE = ((1, 1, 1, 1), (0, 50, 20, 33), 0)


@dataclasses.dataclass(frozen=True)
class Case:
  cache_dtype: str
  layout: str = "NHD"
  q_dtype: object = jnp.bfloat16
  group: int = 4
  head_size: int = 64
  block_size: int = 16
  batch: Tuple = RAGGED
  scales: Tuple = (None, None)      # k_scale, v_scale (scalar or [H])
  window: Optional[int] = None
  soft_cap: Optional[float] = None
  sinks: bool = False
  causal: bool = True
  max_query_len: Optional[int] = None

  @property
  def id(self):
    kind = "decode" if self.batch is DECODE else "ragged"
    extra = "".join(f"-{k}" for k, v in (("win", self.window), ("cap", self.soft_cap),
                                           ("sinks", self.sinks)) if v)
    return (f"{self.cache_dtype}-{self.layout}-{np.dtype(self.q_dtype).name}-G{self.group}-"
            f"D{self.head_size}-N{self.block_size}-{kind}{extra}")


SLOW = pytest.mark.slow

CASES = [
    Case("auto", "NHD"),
    Case("bfloat16", "HND", group=7, head_size=80, block_size=32, window=9, causal=False),
    Case("auto", "NHD", group=1, head_size=128, soft_cap=4.0, sinks=True, batch=DECODE,
         max_query_len=1),
    Case("fp8", "NHD", scales=(0.5, 2.0), batch=DECODE, max_query_len=1, window=25),
    Case("int8_per_token_head", "NHD", head_size=80, window=20, soft_cap=5.0),
    Case("int8_per_token_head", "HND", batch=DECODE, max_query_len=1, window=40),
    Case("int4_per_token_head", "HND", batch=DECODE, max_query_len=1, sinks=True, soft_cap=5.0),
    Case("nvfp4", "HND", group=2, scales=(0.5, 2.0), sinks=True),
    Case(TOY.name, "NHD", scales=(0.5, 2.0)),
    pytest.param(Case("auto", "HND", window=30), marks=SLOW),
    pytest.param(Case("float32", "HND", group=2, batch=DECODE, max_query_len=1),  # f32 cache,
                 marks=SLOW),                                                   # bf16 q
    pytest.param(Case("float32", "NHD", q_dtype=jnp.float32, group=2, window=12, sinks=True,
                      max_query_len=20), marks=SLOW),
    pytest.param(Case("float16", "HND", q_dtype=jnp.float16, group=2, head_size=128,
                      max_query_len=64), marks=SLOW),
    pytest.param(Case("fp8_e5m2", "HND", scales=((0.5, 0.25), (2.0, 1.0))), marks=SLOW),
    pytest.param(Case("fp8_e5m2", "NHD", scales=((0.5, 0.25), (2.0, 1.0)), batch=DECODE,
                      max_query_len=1), marks=SLOW),
    pytest.param(Case("fp8_per_token_head", "HND", group=7, batch=DECODE, max_query_len=1,
                      sinks=True), marks=SLOW),
    pytest.param(Case("int4_per_token_head", "NHD", group=5, head_size=128, block_size=32,
                      max_query_len=32), marks=SLOW),
    pytest.param(Case("nvfp4", "HND", group=1, head_size=32, scales=(1.5, 0.75), batch=DECODE,
                      max_query_len=1), marks=SLOW),              # S = 2: V scales stored linearly
    pytest.param(Case(TOY.name, "HND", scales=(0.25, 4.0), batch=DECODE, max_query_len=1),
                 marks=SLOW),
]


def _case_id(c):
  return c.id


TOY_BACKEND_CASES = {CASES[i].id for i in (0, 7, 8)}      # plain, nvfp4, the toy format


def _tolerance(q_dtype, spec):
  if np.dtype(q_dtype) == np.float32 and spec.storage_dtype == np.float32:
    return 2e-5
  return 4e-3 if np.dtype(q_dtype) == np.float16 else 2e-2


def _assert_close(out, want, tol):
  """|out - want| <= tol * (|want| + max |want|): relative to the data's magnitude."""
  err = np.abs(out - want)
  bound = tol * (np.abs(want) + np.abs(want).max())
  assert np.all(err <= bound), f"max err {err.max():.3e}, bound at worst {bound.min():.3e}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("impl", implementations("attention"))
def test_attention_matches_float64_oracle(rng, impl, case, request):
  if impl == TOY_BACKEND and case.id not in TOY_BACKEND_CASES:
    pytest.skip("the toy backend runs a few cases (it shows the mechanism)")
  if case.cache_dtype == TOY.name:
    request.getfixturevalue("toy_format")
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=case.head_size, block_size=case.block_size,
                           cache_dtype=case.cache_dtype, layout=case.layout)
  interpret = run_mode("attention", impl, spec, case.q_dtype)
  ks, vs = (None if s is None else jnp.asarray(s, jnp.float32) for s in case.scales)
  q_lens, prefix, pad = case.batch
  hq = 2 * case.group
  q, cache, meta, kk, vv = build_batch(rng, spec, q_lens, prefix, hq, pad, ks, vs, case.q_dtype)
  sinks = (jnp.asarray(rng.standard_normal(hq) * 2, jnp.float32) if case.sinks else None)
  scale = case.head_size ** -0.5
  kw = dict(scale=scale, causal=case.causal, sliding_window=case.window,
            soft_cap=case.soft_cap, max_query_len=case.max_query_len, impl=impl,
            interpret=interpret)

  @jax.jit
  def run(q, cache, meta, sinks, ks, vs):
    return kvjax.unified_attention(q, cache, spec, sinks=sinks, k_scale=ks, v_scale=vs, **meta,
                                   **kw)

  with jax.default_matmul_precision("highest"):       # float32 dots in float32 on any device
    out = run(q, cache, meta, sinks, ks, vs)
  assert out.shape == q.shape and out.dtype == q.dtype
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all(), "output holds NaN/inf: a poisoned byte was read"
  if impl == "reference":     # the oracle of the others, against float64 numpy
    want = numpy_attention(q, meta, kk, vv, scale=scale, causal=case.causal,
                           window=case.window, soft_cap=case.soft_cap,
                           sinks=None if sinks is None else np.asarray(sinks))
    tol = _tolerance(case.q_dtype, spec) if np.dtype(case.q_dtype) != np.float32 else 2e-5
  else:
    want = np.asarray(jax.jit(functools.partial(
        kvjax.unified_attention, spec=spec, scale=scale, causal=case.causal,
        sliding_window=case.window, soft_cap=case.soft_cap, max_query_len=case.max_query_len,
        impl="reference"))(q, cache, sinks=sinks, k_scale=ks, v_scale=vs, **meta), np.float32)
    tol = _tolerance(case.q_dtype, spec)
  _assert_close(out, want, tol)
  real = int(meta["query_start_loc"][-1])
  assert not out[real:].any(), "padding tokens must output exactly 0"


# -- metadata outside the contract, traced under jit: kvjax.ragged_batch's rules ------------
def _full_cache(rng, spec, num_blocks):
  """Every slot of every block written (clamped block ids may read any block)."""
  t = num_blocks * spec.block_size
  k, v = (jnp.asarray(rng.standard_normal((t, spec.num_kv_heads, spec.head_size)), spec.dtype)
          for _ in range(2))
  return jit_reference_write(spec.allocate(num_blocks), k, v, jnp.arange(t, dtype=jnp.int32),
                             spec)


# (query_start_loc, seq_lens, block-table fill, max_query_len): T = 6, S = 4 (decode: T = S)
INVALID_METADATA = [
    ([2, 3, 5, 6, 6], [4, 30, 500, -3], "wild", None),   # qsl[0] > 0, seq_lens < 0 / > capacity,
                                                         # block ids < 0 and >= B
    ([0, 4, 2, 5, 9], [8, 5, 7, 6], "ok", None),          # decreasing entry, end past T
    ([0, 1, 4, 5, 6], [7, 9, 12, 5], "ok", 2),            # a sequence above max_query_len
    ([0, 1, 1, 2, 4], [9, 17, 33, 5], "ok", 1),           # decode batch, empty seq in between
    pytest.param([0, 2, 3, 4, 6], [-3, 1, 500, 6], "ok", None, marks=SLOW),
    pytest.param([0, 1, 3, 4, 6], [20, 13, 9, 40], "wild", None, marks=SLOW),
    pytest.param([0, 1, 2, 2, 3], [9, 600, 33, -1], "wild", 1, marks=SLOW),
    pytest.param([1, 2, 3, 4, 4], [9, 17, 33, 5], "ok", 1, marks=SLOW),   # decode, shifted
]


@pytest.mark.parametrize("qsl,seq_lens,table,max_query_len", INVALID_METADATA)
@pytest.mark.parametrize("impl", implementations("attention", but=("reference",)))
def test_metadata_outside_the_contract_gives_the_reference_answer(rng, impl, qsl, seq_lens, table,
                                                                  max_query_len, request):
  """Under jit nothing can be checked: every implementation applies the same rules."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16, layout="HND")
  interpret = run_mode("attention", impl, spec, jnp.bfloat16)
  known_gap(request, "attention", impl, "metadata_rules", strict=False)
  num_blocks, max_blocks = 6, 3
  cache = _full_cache(rng, spec, num_blocks)
  s = len(seq_lens)
  t = s if max_query_len == 1 else 6
  bt = rng.integers(0, num_blocks, (s, max_blocks))
  if table == "wild":
    bt[0, 0], bt[-1, -1], bt[1, 1] = -7, num_blocks + 3, 2**31 - 1
  q = jnp.asarray(rng.standard_normal((t, 4, 32)), jnp.bfloat16)
  meta = dict(query_start_loc=jnp.asarray(qsl, jnp.int32),
              seq_lens=jnp.asarray(seq_lens, jnp.int32), block_table=jnp.asarray(bt, jnp.int32))

  def run(name, interp):
    f = jax.jit(lambda q, c, m: kvjax.unified_attention(
        q, c, spec, scale=0.2, max_query_len=max_query_len, impl=name, interpret=interp, **m))
    return np.asarray(f(q, cache, meta), np.float32)

  want = run("reference", None)
  assert np.isfinite(want).all() and np.abs(want).max() > 0
  _assert_close(run(impl, interpret), want, 2e-2)


@pytest.mark.parametrize("max_query_len", [1, pytest.param(8, marks=SLOW)])
@pytest.mark.parametrize("impl", implementations("attention"))
def test_traced_softmax_and_tensor_scales(rng, impl, max_query_len, request):
  """jax.jit(kvjax.unified_attention) traces every argument, the softmax scale included
  (head size 64: every kernel takes it)."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16, cache_dtype="fp8")
  interpret = run_mode("attention", impl, spec, jnp.bfloat16)
  known_gap(request, "attention", impl, "traced_scale")
  cache = _full_cache(rng, spec, 6)
  s = 3
  t = s if max_query_len == 1 else 8
  q = jnp.asarray(rng.standard_normal((t, 4, 64)), jnp.bfloat16)
  meta = dict(query_start_loc=jnp.asarray([0, 1, 2, 3] if max_query_len == 1 else [0, 1, 6, 8],
                                          jnp.int32),
              seq_lens=jnp.asarray([5, 30, 44], jnp.int32),
              block_table=jnp.asarray(rng.integers(0, 6, (s, 3)), jnp.int32))

  @jax.jit
  def run(q, c, scale, ks):
    return kvjax.unified_attention(q, c, spec, scale=scale, k_scale=ks,
                                   max_query_len=max_query_len, impl=impl, interpret=interpret,
                                   **meta)

  out = np.asarray(run(q, cache, jnp.float32(0.3), jnp.float32(0.5)), np.float32)
  want = kvjax.reference.unified_attention(q, cache, spec, scale=0.3, k_scale=0.5, **meta)
  _assert_close(out, np.asarray(want, np.float32), 2e-2)


# -- an fp8 query with its dequantization scale ------------------------------------------------
@pytest.mark.parametrize("cache_dtype,batch,max_query_len", [
    ("fp8", DECODE, 1), ("int8_per_token_head", RAGGED, None),
    pytest.param("auto", RAGGED, None, marks=SLOW)])
@pytest.mark.parametrize("impl", implementations("attention"))
def test_fp8_query_with_q_scale(rng, impl, cache_dtype, batch, max_query_len):
  """q float8_e4m3fn with q_scale on every implementation: attention of ``q * q_scale``
  (float64 oracle), output in bfloat16."""
  if impl == TOY_BACKEND:
    pytest.skip("the toy backend runs a few cases (it shows the mechanism)")
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16, cache_dtype=cache_dtype)
  interpret = run_mode("attention", impl, spec, jnp.bfloat16)
  q_lens, prefix, pad = batch
  q, cache, meta, kk, vv = build_batch(rng, spec, q_lens, prefix, 8, pad, q_dtype=jnp.float32)
  q_scale = 0.37
  q8 = (q / q_scale).astype(jnp.float8_e4m3fn)
  scale = 64 ** -0.5
  out = jax.jit(lambda q8, cache, meta: kvjax.unified_attention(
      q8, cache, spec, scale=scale, q_scale=q_scale, max_query_len=max_query_len, impl=impl,
      interpret=interpret, **meta))(q8, cache, meta)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  want = numpy_attention(np.asarray(q8, np.float64) * q_scale, meta, kk, vv, scale=scale,
                         causal=True, window=None, soft_cap=None, sinks=None)
  _assert_close(np.asarray(out, np.float32), want, 2e-2)


def test_fp8_query_traced_q_scale_and_errors(rng):
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16, cache_dtype="fp8")
  cache = _full_cache(rng, spec, 6)
  q = jnp.asarray(rng.standard_normal((3, 4, 64)), jnp.float32)
  q8 = (q / 0.5).astype(jnp.float8_e5m2)
  meta = dict(query_start_loc=jnp.asarray([0, 1, 2, 3]), seq_lens=jnp.asarray([5, 30, 44]),
              block_table=jnp.asarray(rng.integers(0, 6, (3, 3)), jnp.int32))
  run = jax.jit(lambda q8, s: kvjax.unified_attention(q8, cache, spec, scale=0.125, q_scale=s,
                                                      max_query_len=1, impl="xla", **meta))
  want = kvjax.unified_attention(q8.astype(jnp.float32) * 0.5, cache, spec, scale=0.125,
                                 impl="reference", **meta)
  _assert_close(np.asarray(run(q8, jnp.float32(0.5)), np.float32), np.asarray(want, np.float32),
                2e-2)
  attend = functools.partial(kvjax.unified_attention, cache=cache, spec=spec, scale=0.125, **meta)
  with pytest.raises(ValueError, match="needs q_scale"):
    attend(q8)
  with pytest.raises(ValueError, match="q_scale is for an fp8 q .* q is float32"):
    attend(q, q_scale=0.5)
  with pytest.raises(ValueError, match="q_scale must be a finite positive scalar"):
    attend(q8, q_scale=-1.0)
  with pytest.raises(TypeError, match="q_scale must be a float"):
    attend(q8, q_scale="0.5")
  with pytest.raises(ValueError, match=r"q_scale must be a scalar, got shape \(1,\)"):
    jax.jit(lambda s: attend(q8, q_scale=s))(jnp.ones((1,), jnp.float32))


# -- the step's write and attention in one call ---------------------------------------------------
@pytest.mark.parametrize("cache_dtype,layout", [("int8_per_token_head", "NHD"),
                                                pytest.param("nvfp4", "HND", marks=SLOW)])
@pytest.mark.parametrize("impl", implementations("attention", but=(TOY_BACKEND,)))
def test_write_and_attend_equals_write_then_attend(rng, impl, cache_dtype, layout):
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16, cache_dtype=cache_dtype,
                           layout=layout)
  interpret = run_mode("attention", impl, spec, jnp.bfloat16)
  q_lens, prefix, pad = RAGGED
  q, cache, meta, _, _ = build_batch(rng, spec, q_lens, prefix, 8, pad, q_dtype=jnp.bfloat16)
  t = q.shape[0]
  new = [jnp.asarray(rng.standard_normal((t, 2, 64)), jnp.bfloat16) for _ in range(2)]
  # the step's tokens go to fresh slots of its sequences' last pages, one padded token skipped
  slots = jnp.asarray(rng.permutation(cache.shape[0] * 16)[:t].astype(np.int32)).at[-1].set(-1)
  kw = dict(scale=0.125, max_query_len=None, impl=impl, interpret=interpret,
            k_scale=0.5 if cache_dtype == "nvfp4" else None,
            v_scale=2.0 if cache_dtype == "nvfp4" else None)
  step = jax.jit(lambda q, c, k, v, s, m: kvjax.write_and_attend(q, k, v, s, c, spec, **m, **kw))
  out, written = step(q, cache, *new, slots, meta)
  wkw = {k: kw[k] for k in ("k_scale", "v_scale")}
  want_cache = jax.jit(lambda c, k, v, s: kvjax.write_kv(c, k, v, s, spec, **wkw))(cache, *new,
                                                                                   slots)
  want = jax.jit(lambda q, c, m: kvjax.unified_attention(q, c, spec, **m, **kw))(q, want_cache,
                                                                                 meta)
  np.testing.assert_array_equal(np.asarray(written).view(np.uint8),
                                np.asarray(want_cache).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  assert np.isfinite(np.asarray(out, np.float32)[:int(meta["query_start_loc"][-1])]).all()
