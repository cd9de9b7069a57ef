"""The torch facade's shape buckets (sequences, block-table width, write slots) and matmul
precision, on CPU: a mixed serving schedule compiles a bounded number of programs, the
padded calls equal kvjax's reference, and torch's float32 matmul precision reaches the
traced computation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import kvjax
import torch_bridge as tb
from torch_bridge import jitted
from torch_bridge import vllm_adapter as va
from torch_testing import cache_array, poison, rand_bf16, to_jnp

H, HQ, D, N, B = 1, 2, 16, 16, 48
GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32)     # vLLM-style padded token counts
BUDGET = 32                                # token budget per step
COMPILE = "/jax/core/compile/backend_compile_duration"


class _Layer:
  _k_scale = _v_scale = torch.tensor(1.0)


def _schedule(rng, steps):
  """Random arrivals, chunked prefills, decodes and finishes: per step, the list of
  (request id, cached tokens before the step, new tokens) and the ids that finished."""
  live, next_id, out = {}, 0, []     # id -> [prompt left, cached, decodes left]
  for _ in range(steps):
    for _ in range(rng.poisson(0.6)):
      live[next_id] = [int(rng.integers(1, 40)), 0, int(rng.integers(1, 12))]
      next_id += 1
    budget, step = BUDGET, []
    for rid, (prompt, cached, decodes) in list(live.items()):
      if budget == 0 or len(step) == 8:
        break
      new = min(prompt, budget) if prompt else 1
      budget -= new
      step.append((rid, cached, new))
    done = []
    for rid, cached, new in step:
      st = live[rid]
      if st[0]:
        st[0] -= new
      else:
        st[2] -= 1
      st[1] += new
      if not st[0] and st[2] == 0:
        del live[rid]
        done.append(rid)
    out.append((step, done))
  return out


def _run_step(rng, impl, kv_cache, step, tables):
  """One step (request id, cached tokens, new tokens) through the adapter, padded to a graph
  size; returns (real tokens, T, block table width, metadata, q, output)."""
  n = sum(new for _, _, new in step)
  t = min(s for s in GRAPH_SIZES if s >= n)
  width = max(len(tables[rid]) for rid, _, _ in step)
  table = np.array([tables[r] + [0] * (width - len(tables[r])) for r, _, _ in step], np.int32)
  slot = lambda r, p: tables[r][p // N] * N + p % N
  slots = np.array([slot(r, p) for r, c, new in step for p in range(c, c + new)], np.int64)
  qsl = np.concatenate([[0], np.cumsum([new for _, _, new in step])]).astype(np.int32)
  seq_lens = np.array([c + new for _, c, new in step], np.int32)
  md = va.KVJaxAttentionMetadata(
      torch.from_numpy(qsl), torch.from_numpy(seq_lens), torch.from_numpy(table),
      torch.from_numpy(slots), max_query_len=int(np.diff(qsl).max()),
      max_seq_len=int(seq_lens.max()), num_actual_tokens=n)
  key, value = rand_bf16(rng, (t, H, D)), rand_bf16(rng, (t, H, D))
  impl.do_kv_cache_update(_Layer(), key, value, kv_cache, md.slot_mapping)
  q = rand_bf16(rng, (t, HQ, D))
  out = torch.zeros(t, HQ, D, dtype=torch.bfloat16)
  impl.forward(_Layer(), q, key, value, kv_cache, md, output=out)
  return n, t, width, md, q, out


@pytest.mark.parametrize("num_steps", [30, pytest.param(200, marks=pytest.mark.slow)])
def test_mixed_schedule_compiles_a_bounded_number_of_programs(rng, num_steps):
  """A random serving schedule through the vLLM adapter: each op compiles once per bucketed
  shape (30 steps: ~22 programs; the slow tier's 200 steps: ~50), within the O(log) bound,
  and a few steps equal the reference."""
  impl = va.KVJaxAttentionImpl(HQ, D, D ** -0.5, H, None, None, "auto")
  backend = tb.PagedAttentionBackend(HQ, H, D, N)
  spec = backend.spec
  kv_cache = backend.allocate_kv_cache(B)
  poison(rng, kv_cache, spec)
  steps = _schedule(rng, num_steps)
  free = list(rng.permutation(B))
  tables = {}
  compiles, seen = [], set()
  listener = lambda event, secs, **kw: compiles.append(event) if event == COMPILE else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  checked, every = 0, num_steps // 5
  try:
    for i, (step, done) in enumerate(steps):
      if not step:
        continue
      for rid, cached, new in step:
        need = -(-(cached + new) // N)
        tables.setdefault(rid, [])
        while len(tables[rid]) < need:
          tables[rid].append(free.pop())
      n, t, width, md, q, out = _run_step(rng, impl, kv_cache, step, tables)
      seen.add((t, len(step), width, jitted.query_len_bucket(md.max_query_len, t)))
      if i % every == every // 2:    # 5 steps against the reference (compiled outside the count)
        jax.monitoring.unregister_event_duration_listener(listener)
        ref = kvjax.reference.unified_attention(
            to_jnp(q[:n]), cache_array(kv_cache, spec), spec,
            **{k: jnp.asarray(getattr(md, k).numpy())
               for k in ("query_start_loc", "seq_lens", "block_table")}, scale=D ** -0.5)
        ref = np.asarray(ref.astype(jnp.float32))
        got = out[:n].float().numpy()
        assert (np.abs(got - ref) <= 2.0 ** -7 * np.abs(ref).max(-1, keepdims=True) + 1e-6).all()
        checked += 1
        jax.monitoring.register_event_duration_secs_listener(listener)
      for rid in done:
        free += tables.pop(rid)
    # Bucketing merges shapes: decodes of 5 and then 6 sequences (T = 8) share one bucket
    # (S -> 7), so the second step compiles nothing.
    fresh = backend.allocate_kv_cache(B)
    for num_seqs in (5, 6):
      before = len(compiles)
      step = [(rid, 0, 1) for rid in range(num_seqs)]
      _, t, width, md, _, _ = _run_step(rng, impl, fresh, step, {r: [r] for r in range(6)})
      seen.add((t, num_seqs, width, jitted.query_len_bucket(md.max_query_len, t)))
    assert len(compiles) == before, "a step of the same bucket compiled again"
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  sizes = {k[0] for k in seen}
  assert checked >= 3 and len(compiles) >= len(sizes)
  # one write program per token count T; one attention program per bucketed key
  bucketed = {(t, jitted.num_seqs_bucket(s, t), jitted.table_width_bucket(w), m)
              for t, s, w, m in seen}
  # the O(log) bound per T: sequence buckets (powers of two below T, or T) x width buckets
  # (powers of two up to the widest table) x query-length buckets (powers of two up to T)
  widest = max(k[2] for k in seen)
  bound = sum(1 + (t.bit_length() + 1) * widest.bit_length() * (t.bit_length() + 1)
              for t in sizes)
  print(f"{num_steps}-step schedule: {len(compiles)} compiles = {len(sizes)} writes + "
        f"{len(bucketed)} attention programs ({len(seen)} (T, S, width, query bucket) "
        f"combinations unbucketed; O(log) bound {bound})")
  assert len(compiles) <= len(sizes) + len(bucketed) <= bound
  assert len(bucketed) < len(seen)


def test_sequence_and_width_buckets():
  assert [jitted.num_seqs_bucket(s, 32) for s in (1, 3, 5, 16, 17, 31, 32, 40)] == \
      [1, 4, 8, 16, 31, 31, 32, 40]
  assert jitted.num_seqs_bucket(5, 8) == 7                 # never S == T unless real
  assert [jitted.table_width_bucket(w) for w in (1, 3, 4, 9)] == [1, 4, 4, 16]


def test_padded_slots_skip_and_compile_once_per_key_rows(rng):
  backend = tb.PagedAttentionBackend(HQ, H, D, N)
  spec = backend.spec
  cache = backend.allocate_kv_cache(4)
  poison(rng, cache, spec)
  compiles = []
  listener = lambda event, secs, **kw: compiles.append(event) if event == COMPILE else None
  key, value = rand_bf16(rng, (8, H, D)), rand_bf16(rng, (8, H, D))
  for n in (8, 5, 3):       # the first call compiles; fewer real slots reuse the program
    before = cache_array(cache, spec)
    slots = torch.from_numpy(rng.choice(4 * N, n, replace=False).astype(np.int32))
    if n != 8:
      jax.monitoring.register_event_duration_secs_listener(listener)
    backend.do_kv_cache_update(key, value, cache, slots)
    if n != 8:
      jax.monitoring.unregister_event_duration_listener(listener)
    want = kvjax.reference.write_kv(before, to_jnp(key[:n]), to_jnp(value[:n]),
                                    jnp.asarray(slots.numpy()), spec)
    np.testing.assert_array_equal(np.asarray(cache_array(cache, spec)).view(np.uint16),
                                  np.asarray(want).view(np.uint16))    # bytes (NaN poison)
  assert compiles == []


def _dot_precisions(backend, cache, md, q):
  """Precision params of every dot_general in the facade's traced attention for q."""
  backend.forward(q, cache, md, torch.empty_like(q))
  (fn,) = [f for k, f in backend._attn.items() if k[-1] == backend._precision()]
  cx = backend._crossing(q.device)
  jaxpr = jax.make_jaxpr(fn)(cx.fresh(q), backend._cache_array(cx, backend._cache(cache, None)),
                             *md.jax_arrays(cx, q.shape[0]), None, None, None, None)
  found = []

  def walk(jx):                    # nested jaxprs too (pjit, pallas_call's kernel, loops)
    for eqn in jx.eqns:
      if eqn.primitive.name == "dot_general":
        found.append(eqn.params["precision"])
      for p in eqn.params.values():
        for sub in (p if isinstance(p, (tuple, list)) else (p,)):
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub)
  walk(jaxpr.jaxpr)
  return found


@pytest.mark.parametrize("torch_setting,want", [
    ("highest", jax.lax.Precision.HIGHEST), ("high", jax.lax.Precision.HIGH),
    ("medium", jax.lax.Precision.DEFAULT)])
def test_float32_precision_follows_torch(rng, torch_setting, want):
  # the Pallas ragged kernel (interpret mode on CPU): its dots leave precision to the caller
  backend = tb.PagedAttentionBackend(HQ, H, D, N, dtype=torch.float32, impl="pallas")
  cache = backend.allocate_kv_cache(4)
  md = tb.PagedAttentionMetadata(torch.tensor([0, 2], dtype=torch.int32),
                                 torch.tensor([9], dtype=torch.int32),
                                 torch.tensor([[1]], dtype=torch.int32),
                                 torch.tensor([16, 17], dtype=torch.int32), 2, 9)
  q = torch.from_numpy(rng.standard_normal((2, HQ, D)).astype(np.float32))
  saved = torch.get_float32_matmul_precision()
  try:
    torch.set_float32_matmul_precision(torch_setting)
    precisions = _dot_precisions(backend, cache, md, q)
  finally:
    torch.set_float32_matmul_precision(saved)
  assert precisions and all(p == (want, want) for p in precisions), precisions


def test_bf16_model_keeps_jax_precision(rng):
  backend = tb.PagedAttentionBackend(HQ, H, D, N)
  assert backend._precision() is None
