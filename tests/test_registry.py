"""kvjax.registry: which implementation runs each op, on which platform, and why."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from attention_cases import build_batch
from kv_testing import as_bytes, poisoned_cache, random_kv
from kvjax import registry

SPEC = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16)


@pytest.mark.parametrize("op", ["write", "attention", "read"])
def test_auto_per_platform(op):
  """auto: on CPU the XLA attention and the reference write/read (never an interpret-mode
  kernel), the Triton kernels on GPU, and on a TPU never a Triton kernel."""
  cpu = kvjax.explain(op, SPEC, platform="cpu")
  on_cpu = "xla" if op == "attention" else "reference"
  assert (cpu.name, cpu.interpret) == (on_cpu, False)
  assert ("pallas", "runs compiled on gpu, not cpu") in cpu.skipped
  gpu = kvjax.explain(op, SPEC, platform="gpu")
  assert (gpu.name, gpu.interpret) == ("pallas", False)
  # attention: Mosaic GPU comes first but has a rule (and needs jax >= 0.11 and an sm90 GPU)
  assert [name for name, _ in gpu.skipped] == (["mosaic_gpu"] if op == "attention" else [])
  tpu = kvjax.explain(op, SPEC, platform="tpu")
  assert tpu.name != "pallas"
  assert str(cpu).startswith(f"{op} on cpu: {on_cpu} (compiled)")


def test_named_implementations_and_interpret():
  run = registry.ATTENTION.choose("pallas", None, SPEC, jnp.bfloat16, on="cpu")
  assert (run.name, run.interpret) == ("pallas", True)          # not native on CPU: interpret
  run = registry.ATTENTION.choose("pallas", None, SPEC, jnp.bfloat16, on="gpu")
  assert (run.name, run.interpret) == ("pallas", False)
  run = registry.WRITE.choose("reference", True, SPEC, on="gpu")
  assert (run.name, run.interpret) == ("reference", False)       # nothing to interpret
  with pytest.raises(ValueError, match=r"impl='cuda' is not an implementation of write.*"
                                       r"'pallas'.*'reference'"):
    registry.WRITE.choose("cuda", None, SPEC)
  with pytest.raises(ValueError, match="q dtype int8"):
    registry.ATTENTION.choose("pallas", None, SPEC, jnp.int8, on="gpu")
  skipped = dict(kvjax.explain("attention", SPEC, jnp.int8, platform="gpu").skipped)
  assert "q dtype int8" in skipped["pallas"]
  with pytest.raises(ValueError, match="op='dequant'"):
    kvjax.explain("dequant", SPEC)


def test_a_backend_that_cannot_import_is_passed_over_with_the_reason():
  impl = registry.WRITE.register("mosaic_future", "no_such_module.write:write_kv",
                                 supports="no_such_module.write:supports_write",
                                 platforms=("gpu",), interpretable=True, before="pallas")
  try:
    assert registry.WRITE.names()[0] == "mosaic_future"
    choice = kvjax.explain("write", SPEC, platform="gpu")
    assert choice.name == "pallas"
    assert choice.skipped[0][0] == "mosaic_future" and "no_such_module" in choice.skipped[0][1]
    with pytest.raises(ValueError, match="cannot import"):
      registry.WRITE.choose("mosaic_future", None, SPEC, on="gpu")
    with pytest.raises(ValueError, match="already registered"):
      registry.WRITE.register("mosaic_future", impl.entry)
  finally:
    registry.WRITE.unregister("mosaic_future")
  assert "mosaic_future" not in registry.WRITE.names()


def test_a_prefer_rule_decides_auto_only():
  """``prefer``: auto passes an implementation over where its rule says no (with the
  rule's reason) and takes it where it says yes; a named impl runs regardless."""
  def rule(spec, q_dtype, call):
    if call is None or call.max_query_len is None or call.max_query_len < 64:
      return "only for max_query_len >= 64"
    return None

  registry.ATTENTION.register("long_queries", "kvjax.reference.attention:unified_attention",
                              platforms=("gpu",), prefer=rule, before="mosaic_gpu")
  try:
    short = registry.AttentionCall(num_tokens=8, num_q_heads=8, num_seqs=8, max_blocks=4,
                                   max_query_len=1)
    long = registry.AttentionCall(num_tokens=512, num_q_heads=8, num_seqs=2, max_blocks=32,
                                  max_query_len=256)
    choice = kvjax.explain("attention", SPEC, platform="gpu", call=short)
    assert choice.name == "pallas"
    assert ("long_queries", "only for max_query_len >= 64") in choice.skipped
    assert kvjax.explain("attention", SPEC, platform="gpu").name == "pallas"   # call unknown
    assert kvjax.explain("attention", SPEC, platform="gpu", call=long).name == "long_queries"
    named = registry.ATTENTION.choose("long_queries", None, SPEC, jnp.bfloat16, on="gpu",
                                      call=short)
    assert named.name == "long_queries"
  finally:
    registry.ATTENTION.unregister("long_queries")


def test_mosaic_gpu_auto_rule():
  """The measured rule: Mosaic GPU for static max_query_len >= 128, a GQA group it packs,
  and on quantized caches only where the plain copy of the pages pays."""
  from pallas_kernels.mosaic_gpu import prefer_attention
  from pallas_kernels.mosaic_gpu.tuning import AUTO_MIN_QUERY_LEN

  def call(mql, tokens=16384, hq=32, seqs=4, blocks=256):
    return registry.AttentionCall(num_tokens=tokens, num_q_heads=hq, num_seqs=seqs,
                                  max_blocks=blocks, max_query_len=mql)

  plain = kvjax.KVCacheSpec(8, 128, 16)
  assert "gives none" in prefer_attention(plain, jnp.bfloat16, None)
  assert "gives none" in prefer_attention(plain, jnp.bfloat16, call(None))
  assert "Triton kernels are faster" in prefer_attention(plain, jnp.bfloat16,
                                                         call(AUTO_MIN_QUERY_LEN - 1))
  assert prefer_attention(plain, jnp.bfloat16, call(AUTO_MIN_QUERY_LEN)) is None
  assert "GQA group 32" in prefer_attention(plain, jnp.bfloat16, call(4096, hq=256))
  fp8 = kvjax.KVCacheSpec(8, 128, 16, "fp8")
  assert prefer_attention(fp8, jnp.bfloat16, call(4096)) is None          # prefill: copy pays
  assert "plain copy" in prefer_attention(fp8, jnp.bfloat16, call(128, tokens=192, seqs=64))


def test_ops_decide_for_the_platform_their_cache_is_on(rng, monkeypatch):
  """On a GPU machine a cache placed on the CPU is written, read and attended on the CPU (by an
  implementation that runs there), not handed to a GPU kernel; a jitted call (its cache has no
  device while traced) decides by jax.default_device where that is set. The GPU default
  backend is simulated here."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16,
                           cache_dtype="int8_per_token_head")
  cpu = jax.devices("cpu")[0]
  cache = jax.device_put(poisoned_cache(rng, spec, 4), cpu)
  key, value = random_kv(rng, spec, 3)
  slots = jnp.array([5, 40, -1], jnp.int32)
  want = kvjax.write_kv(cache, key, value, slots, spec, impl="reference")
  q, acache, meta, _, _ = build_batch(rng, spec, [3, 1], [4, 9], 4)
  q, acache, meta = jax.device_put((q, acache, meta), cpu)
  want_out = kvjax.unified_attention(q, acache, spec, scale=0.2, impl="xla", **meta)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert registry.platform() == "gpu" and registry.platform_of(np.zeros(2)) == "gpu"
  assert registry.platform_of(cache) == "cpu"
  got = kvjax.write_kv(cache, key, value, slots, spec)
  np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
  for a, b in zip(kvjax.read_kv(got, spec, slots[:2]), kvjax.read_kv(want, spec, slots[:2],
                                                                     impl="reference")):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  out = kvjax.unified_attention(q, acache, spec, scale=0.2, **meta)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
  with jax.default_device(cpu):
    assert registry.platform() == "cpu"
    jitted = jax.jit(kvjax.write_kv, static_argnums=4)(cache, key, value, slots, spec)
  np.testing.assert_array_equal(as_bytes(jitted), as_bytes(want))


def _platforms_with(*names):
  """This process's platforms plus ``names`` (for monkeypatching ``host_platforms``)."""
  have = set(registry.host_platforms()) | set(names)
  return lambda: tuple(p for p in registry.PLATFORMS if p in have)


def _cpu_write(rng):
  """An int8 per-token-head write placed on the CPU: (spec, cache, key, value, slots, the
  reference's result)."""
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16,
                           cache_dtype="int8_per_token_head")
  cpu = jax.devices("cpu")[0]
  cache = jax.device_put(poisoned_cache(rng, spec, 4), cpu)
  key, value, slots = jax.device_put((*random_kv(rng, spec, 3),
                                      jnp.array([5, 40, -1], jnp.int32)), cpu)
  want = kvjax.write_kv(cache, key, value, slots, spec, impl="reference")
  return spec, cache, key, value, slots, want


def test_a_jitted_op_lowers_the_branch_of_its_platform(rng, monkeypatch):
  """Under jit the cache has no device yet. On a machine with a GPU (simulated here) a step
  jitted over a cache placed on the CPU runs the CPU's implementation, with no
  ``jax.default_device``; the same step lowered for CUDA holds the Triton kernel and not the
  reference's scatter."""
  spec, cache, key, value, slots, want = _cpu_write(rng)
  cpu = jax.devices("cpu")[0]
  q, acache, meta, _, _ = build_batch(rng, spec, [3, 1], [4, 9], 4)
  q, acache, meta = jax.device_put((q, acache, meta), cpu)
  want_out = kvjax.unified_attention(q, acache, spec, scale=0.2, impl="xla", **meta)
  want_kv = kvjax.read_kv(want, spec, slots[:2], impl="reference")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(registry, "host_platforms", _platforms_with("gpu"))

  write = jax.jit(kvjax.write_kv, static_argnums=4)
  np.testing.assert_array_equal(as_bytes(write(cache, key, value, slots, spec)), as_bytes(want))
  out = jax.jit(lambda q, c, m: kvjax.unified_attention(q, c, spec, scale=0.2, **m))(
      q, acache, meta)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
  got_kv = jax.jit(lambda c, s: kvjax.read_kv(c, spec, s))(want, slots[:2])
  for a, b in zip(got_kv, want_kv):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  triton = "__gpu$xla.gpu.triton"
  allow = [jax.export.DisabledSafetyCheck.custom_call(triton)]
  args = (cache, key, value, slots, spec)
  on_gpu = jax.export.export(write, platforms=["cuda"], disabled_checks=allow)(*args)
  assert triton in on_gpu.mlir_module() and "scatter" not in on_gpu.mlir_module()
  on_cpu = write.lower(*args).as_text()
  assert triton not in on_cpu and "scatter" in on_cpu


@pytest.mark.parametrize("cache_dtype", ["auto", "int8_per_token_head"])
def test_a_donated_write_under_platform_branches_stays_in_place(rng, monkeypatch, cache_dtype):
  """The platform branches cost nothing once compiled: the programs hold no conditional and
  the donated cache is written in place (its buffer kept). Here the process has a GPU
  platform besides its own (real on a GPU machine, where this runs the Triton kernel)."""
  monkeypatch.setattr(registry, "host_platforms", _platforms_with("cpu", "gpu"))
  spec = kvjax.KVCacheSpec(num_kv_heads=2, head_size=32, block_size=16, cache_dtype=cache_dtype)
  cache = jnp.asarray(poisoned_cache(rng, spec, 4))
  key, value = random_kv(rng, spec, 3)
  slots = jnp.array([5, 40, -1], jnp.int32)
  want = kvjax.write_kv(cache, key, value, slots, spec)
  jaxpr = str(jax.make_jaxpr(kvjax.write_kv, static_argnums=4)(cache, key, value, slots, spec))
  assert "platform_index" in jaxpr                       # the branches are there while traced
  compiled = jax.jit(kvjax.write_kv, static_argnums=4, donate_argnums=0).lower(
      cache, key, value, slots, spec).compile()
  assert "conditional" not in compiled.as_text()
  ptr = cache.unsafe_buffer_pointer()
  got = compiled(cache, key, value, slots)
  assert got.unsafe_buffer_pointer() == ptr
  np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
  q, acache, meta, _, _ = build_batch(rng, spec, [3, 1], [4, 9], 4)
  attend = jax.jit(lambda q, c, m: kvjax.unified_attention(q, c, spec, scale=0.2, **m))
  read = jax.jit(lambda c, s: kvjax.read_kv(c, spec, s))
  for f, args in ((attend, (q, acache, meta)), (read, (got, slots[:2]))):
    assert "conditional" not in f.lower(*args).compile().as_text()


@pytest.mark.parametrize("impl", ["auto", "pallas", "mosaic_tpu"])
def test_interpret_mode_kernels_take_no_platform_branch(rng, monkeypatch, impl):
  """An interpret-mode kernel runs on any platform, and its host callbacks are effects a
  pruned branch cannot carry through lowering: a jitted call that asks for interpret mode has
  no platform branch (even with GPU and TPU platforms besides the CPU) and runs."""
  monkeypatch.setattr(registry, "host_platforms", _platforms_with("cpu", "gpu", "tpu"))
  spec, cache, key, value, slots, want = _cpu_write(rng)
  cpu = jax.devices("cpu")[0]
  write = lambda c, k, v, s: kvjax.write_kv(c, k, v, s, spec, impl=impl, interpret=True)
  with jax.default_device(cpu):
    assert "platform_index" not in str(jax.make_jaxpr(write)(cache, key, value, slots))
    got = jax.jit(write)(cache, key, value, slots)
  np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
