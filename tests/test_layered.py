"""Layered (cross-layer) caches: every op on one layer of the whole array, in place.

One array holds L layers (``spec.allocate(B, num_layers=L)``); ``write_kv`` / ``read_kv`` /
``unified_attention`` take it with ``layer=`` (kvjax/layers.py). Checked on poisoned caches with
fresh random data: a write touches only the named rows of that layer, reads and attention equal
the same op on a separate one-layer cache holding the layer's bytes, a traced layer index
compiles one program for every layer, and no jitted call copies or slices the cache.
"""
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import kvjax
from kvjax import KVCacheSpec, registry
from kv_testing import as_bytes, poisoned_cache, poisoned_ragged_batch, random_kv
from op_suite import implementations, run_mode

B, L = 4, 3
SLOW = pytest.mark.slow


def _layer_of(cache, spec, layer):
  """numpy copy of layer ``layer`` of a layered physical array: one layer's 4-D cache."""
  return np.take(np.asarray(cache), layer, axis=spec.layer_axis)


def _stacked(rng, spec, one, layer):
  """A layered cache of random bytes whose layer ``layer`` holds the bytes of ``one``."""
  stack = np.array(poisoned_cache(rng, spec, one.shape[0], L))
  index = [slice(None)] * 5
  index[spec.layer_axis] = layer
  stack[tuple(index)] = np.asarray(one)
  return jnp.asarray(stack)


WRITE_CASES = [("auto", "NHD"), ("auto", "HND"), ("int8_per_token_head", "HND"),
               ("int4_per_token_head", "NHD"),
               pytest.param("fp8", "HND", marks=SLOW),
               pytest.param("fp8_per_token_head", "NHD", marks=SLOW)]


@pytest.mark.parametrize("cd,layout", WRITE_CASES)
@pytest.mark.parametrize("impl", implementations("write"))
def test_write_touches_only_the_layers_named_rows(rng, impl, cd, layout):
  """Jitted, donated, traced layer: layer l of the result equals the same write into a copy of
  that layer alone; every other byte keeps its bits. Slots past the layer (>= B*N) and
  negative ones write nothing; one compiled program serves every layer."""
  spec = KVCacheSpec(2, 64, 16, cd, layout)
  interpret = run_mode("write", impl, spec)
  n = spec.block_size
  write = jax.jit(lambda c, k, v, s, l: kvjax.write_kv(c, k, v, s, spec, impl=impl,
                                                       interpret=interpret, layer=l),
                  donate_argnums=0)
  one_layer = jax.jit(lambda c, k, v, s: kvjax.write_kv(c, k, v, s, spec, impl=impl,
                                                        interpret=interpret))
  for layer in range(L):
    cache = poisoned_cache(rng, spec, B, L)
    before = np.asarray(cache).copy()
    valid = rng.choice(B * n, 9, replace=False)
    slots = rng.permutation(np.concatenate([valid, [-1, B * n, B * n + 3, 2**31 - 1]]))
    slots = jnp.asarray(slots.astype(np.int32))
    key, value = random_kv(rng, spec, slots.shape[0] + 2)
    got = np.asarray(write(cache, key, value, slots, jnp.int32(layer)))
    want_layer = one_layer(jnp.asarray(_layer_of(before, spec, layer)), key, value, slots)
    np.testing.assert_array_equal(as_bytes(_layer_of(got, spec, layer)), as_bytes(want_layer))
    for other in set(range(L)) - {layer}:
      np.testing.assert_array_equal(as_bytes(_layer_of(got, spec, other)),
                                    as_bytes(_layer_of(before, spec, other)))
    assert not np.array_equal(as_bytes(got), as_bytes(before))
  assert write._cache_size() == 1


@pytest.mark.parametrize("impl", implementations("write"))
def test_write_with_a_traced_layer_outside_the_stack_writes_nothing(rng, impl):
  spec = KVCacheSpec(2, 32, 16, "auto", "NHD")
  interpret = run_mode("write", impl, spec)
  cache = poisoned_cache(rng, spec, B, L)
  before = as_bytes(cache).copy()
  slots = jnp.asarray(rng.choice(B * 16, 6, replace=False).astype(np.int32))
  key, value = random_kv(rng, spec, 6)
  write = jax.jit(lambda c, l: kvjax.write_kv(c, key, value, slots, spec, impl=impl,
                                              interpret=interpret, layer=l))
  for layer in (-1, L, 2**31 - 1):
    np.testing.assert_array_equal(as_bytes(write(cache, jnp.int32(layer))), before)


ATTENTION_CASES = [("auto", "NHD", 64), ("auto", "HND", 64), ("int8_per_token_head", "NHD", 64),
                   ("int8_per_token_head", "HND", 1),
                   pytest.param("fp8", "NHD", 64, marks=SLOW),
                   pytest.param("int4_per_token_head", "HND", 64, marks=SLOW)]


@pytest.mark.parametrize("cd,layout,max_query_len", ATTENTION_CASES)
@pytest.mark.parametrize("impl", implementations("attention"))
def test_attention_on_a_layer_equals_a_one_layer_cache(rng, impl, cd, layout, max_query_len):
  """A ragged batch (or a decode batch) on layer l of a layered cache whose other layers are
  poison, jitted with a traced layer: the same output as on a cache of that layer alone. Kernels
  refuse an HND layered cache (a layer's page is not contiguous), naming the reason."""
  spec = KVCacheSpec(2, 64, 16, cd, layout)
  interpret = run_mode("attention", impl, spec, spec.dtype)
  ks = vs = 0.5 if spec.format.has_tensor_scales else None
  if max_query_len == 1:
    q_lens, ctx, pad = (1, 1, 1, 1), (40, 0, 17, 33), 0
  else:
    q_lens, ctx, pad = (7, 1, 20, 0, 1), (0, 40, 17, 5, 33), 3
  q, one, qsl, sl, bt = poisoned_ragged_batch(rng, spec, 8, q_lens, ctx, pad, ks, vs)
  layer = int(rng.integers(L))
  stack = _stacked(rng, spec, one, layer)
  kw = dict(query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=0.125, k_scale=ks,
            v_scale=vs, max_query_len=max_query_len, impl=impl, interpret=interpret)
  attend = jax.jit(lambda q, c, l: kvjax.unified_attention(q, c, spec, layer=l, **kw))
  if not registry.ATTENTION.get(impl).xla and layout == "HND":
    with pytest.raises(ValueError, match=f"impl='{impl}' cannot run.*layered HND cache"):
      attend(q, stack, jnp.int32(layer))
    return
  got = np.asarray(attend(q, stack, jnp.int32(layer)), np.float32)
  want = np.asarray(jax.jit(lambda q, c: kvjax.unified_attention(q, c, spec, **kw))(q, one),
                    np.float32)
  assert np.abs(want).max() > 0.1
  np.testing.assert_array_equal(got, want)


def test_a_traced_layer_compiles_one_attention_program_for_every_layer(rng):
  """Every layer of one layered cache through one jitted function: each result equals the op
  on that layer alone, after a single compilation (reference and Pallas interpret)."""
  spec = KVCacheSpec(2, 32, 16, "auto", "NHD")
  hq, every_slot = 4, jnp.arange(B * spec.block_size, dtype=jnp.int32)
  stack = spec.allocate(B, num_layers=L)
  for layer in range(L):
    stack = kvjax.write_kv(stack, *random_kv(rng, spec, every_slot.shape[0]), every_slot, spec,
                           layer=layer)
  for impl, interpret in (("reference", None), ("pallas", True)):
    kw = dict(query_start_loc=jnp.asarray([0, 1, 4]), seq_lens=jnp.asarray([40, 20]),
              block_table=jnp.asarray([[3, 0, 2], [1, 2, 0]]), scale=0.2, max_query_len=3,
              impl=impl, interpret=interpret)
    attend = jax.jit(lambda q, c, l: kvjax.unified_attention(q, c, spec, layer=l, **kw))
    for layer in range(L):
      q = jnp.asarray(rng.standard_normal((5, hq, 32)), spec.dtype)
      one = jnp.asarray(_layer_of(stack, spec, layer))
      got = np.asarray(attend(q, stack, jnp.int32(layer)), np.float32)
      want = np.asarray(kvjax.unified_attention(q, one, spec, **kw), np.float32)
      np.testing.assert_array_equal(got, want)
      assert np.abs(got[:4]).max() > 0.01 and not np.any(got[4:])   # token 4 is padding
    assert attend._cache_size() == 1, impl


READ_CASES = [("auto", "NHD"), ("int8_per_token_head", "HND"),
              pytest.param("int4_per_token_head", "NHD", marks=SLOW)]


@pytest.mark.parametrize("cd,layout", READ_CASES)
@pytest.mark.parametrize("impl", implementations("read"))
def test_read_on_a_layer_equals_a_one_layer_cache(rng, impl, cd, layout):
  """read_kv of layer l (traced) equals read_kv of that layer alone, bit for bit; a traced
  layer outside the stack reads NaN rows."""
  spec = KVCacheSpec(2, 64, 16, cd, layout)
  interpret = run_mode("read", impl, spec)
  one = spec.allocate(B)
  slots = jnp.asarray(rng.choice(B * 16, 12, replace=False).astype(np.int32))
  key, value = random_kv(rng, spec, 12)
  one = kvjax.write_kv(one, key, value, slots, spec)
  layer = int(rng.integers(L))
  stack = _stacked(rng, spec, one, layer)
  read = jax.jit(lambda c, l: kvjax.read_kv(c, spec, slots, impl=impl, interpret=interpret,
                                            layer=l))
  want = kvjax.read_kv(one, spec, slots, impl=impl, interpret=interpret)
  for got, w in zip(read(stack, jnp.int32(layer)), want):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
  for got in read(stack, jnp.int32(L)):
    assert np.isnan(np.asarray(got)).all()
  assert read._cache_size() == 1


def test_eager_python_int_layers_and_numpy_layers(rng):
  """``layer`` as a Python int or a numpy integer, eagerly: the same bytes as a traced one."""
  spec = KVCacheSpec(2, 32, 16, "int8_per_token_head", "HND")
  cache = poisoned_cache(rng, spec, B, L)
  slots = jnp.asarray([3, 17, 40], jnp.int32)
  key, value = random_kv(rng, spec, 3)
  want = kvjax.write_kv(cache, key, value, slots, spec, layer=jnp.int32(2))
  for layer in (2, np.int64(2), np.asarray(2, np.int16)):
    got = kvjax.write_kv(cache, key, value, slots, spec, layer=layer)
    np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
  k, v = kvjax.read_kv(want, spec, slots, layer=2)
  k1, v1 = kvjax.read_kv(jnp.asarray(_layer_of(want, spec, 2)), spec, slots)
  np.testing.assert_array_equal(np.asarray(k), np.asarray(k1))


def test_worked_numbers_of_docs_layout():
  """docs/layout.md §2, layered caches: B = 10, L = 4, bf16, H = 8, N = 16, D = 128."""
  from kvjax.layers import Stack
  for layout, big in (("NHD", (10, 64, 8, 256)), ("HND", (10, 8, 64, 256))):
    spec = KVCacheSpec(8, 128, 16, "auto", layout)
    cache = jax.ShapeDtypeStruct(spec.physical_shape(10, 4), spec.storage_dtype)
    stack = Stack(10, 4, 2)
    view, big_spec = stack.write_view(jnp.zeros(cache.shape, cache.dtype), spec)
    assert view.shape == big and big_spec.block_size == 64
    assert int(stack.write_slots(jnp.asarray([7 * 16 + 5, -1, 160], jnp.int32), 16)[0]) == 485
    np.testing.assert_array_equal(stack.write_slots(jnp.asarray([-1, 160], jnp.int32), 16), -1)
    _, blocks = stack.attention_operands(jnp.zeros(cache.shape, cache.dtype), spec,
                                         jnp.asarray([[7, 12, -3]]), xla=True)
    np.testing.assert_array_equal(blocks, [[30, 9 * 4 + 2, 2]])     # clipped to [0, B) first
  assert KVCacheSpec(8, 128, 16).physical_shape(10, 4) == (10, 4, 16, 8, 256)


# -- no copy, no slice of the cache -----------------------------------------------------------
_ALLOW = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
#: What may touch the cache on its way into a kernel: free reshapes and bitcasts (the
#: per-token-head formats' float32 view of the same bytes for their row scales; measured on
#: the H200 to allocate nothing), the kernel call itself.
_OK_OPS = ("stablehlo.reshape", "stablehlo.bitcast_convert", "stablehlo.custom_call", "call ",
           "func.func", "return ")


def _cache_lines(text, nbytes):
  """Lines of a StableHLO module that name a tensor of ``nbytes`` bytes (the cache in any
  element type: the write kernel sees one-byte caches as uint32 words)."""
  for line in text.splitlines():
    for dims, etype in re.findall(r"tensor<([\dx]+)x([a-z]\w*)>", line):
      width = re.search(r"\d+", etype)                   # ui8, bf16, f8E4M3FN, ui32, ...
      if width and math.prod(int(d) for d in dims.split("x")) * int(width.group()) == 8 * nbytes:
        yield line.strip()
        break


@pytest.mark.parametrize("op", ["decode", "ragged", "write"])
def test_the_cuda_lowering_hands_the_whole_cache_to_the_kernel(op):
  """Exported for CUDA (the lowering the GPU runs), a jitted layered call with a traced layer
  only reshapes (or bitcasts) the cache on its way into the Triton kernel: no slice, gather,
  transpose or copy of it; a donated write aliases it to the output."""
  spec = KVCacheSpec(2, 64, 16, "int8_per_token_head", "NHD")
  shape = spec.physical_shape(8, 4)
  cache = jax.ShapeDtypeStruct(shape, spec.storage_dtype)
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  if op == "write":
    kv = jax.ShapeDtypeStruct((10, 2, 64), spec.dtype)
    f = lambda c, k, v, s, l: kvjax.write_kv(c, k, v, s, spec, impl="pallas", interpret=False,
                                             layer=l)
    args, fn = (cache, kv, kv, i32(10), i32()), jax.jit(f, donate_argnums=0)
  else:
    t = 4 if op == "decode" else 16
    q = jax.ShapeDtypeStruct((t, 8, 64), spec.dtype)
    f = lambda q, c, qsl, sl, bt, l: kvjax.unified_attention(
        q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=0.1,
        max_query_len=1 if op == "decode" else 8, impl="pallas", interpret=False, layer=l)
    args, fn = (q, cache, i32(5), i32(4), i32(4, 3), i32()), jax.jit(f)
  text = export.export(fn, platforms=["cuda"], disabled_checks=_ALLOW)(*args).mlir_module()
  lines = list(_cache_lines(text, math.prod(shape) * np.dtype(spec.storage_dtype).itemsize))
  assert any("custom_call @__gpu$xla.gpu.triton" in x for x in lines)
  bad = [x for x in lines if not any(op_name in x for op_name in _OK_OPS)]
  assert not bad, bad
  if op == "write":
    assert "tf.aliasing_output = 0" in text and "output_operand_aliases" in text


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_compiled_reference_materializes_no_layer(layout):
  """XLA on CPU, reference attention on a traced layer: no buffer as large as one layer of the
  cache is made (the page view's reshape, and HND's transpose, fuse into the page gathers);
  the donated layered write is in place."""
  spec = KVCacheSpec(2, 64, 16, "auto", layout)
  shape = spec.physical_shape(8, 4)
  cache = jax.ShapeDtypeStruct(shape, spec.storage_dtype)
  layer_elems = math.prod(shape) // 4
  i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
  q = jax.ShapeDtypeStruct((4, 8, 64), spec.dtype)
  f = lambda q, c, qsl, sl, bt, l: kvjax.unified_attention(
      q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=0.1,
      max_query_len=1, impl="reference", layer=l)
  hlo = jax.jit(f).lower(q, cache, i32(5), i32(4), i32(4, 3), i32()).compile().as_text()
  entry = hlo[hlo.index("\nENTRY"):]
  big = []
  for line in entry.splitlines()[1:]:
    m = re.match(r"\s*(ROOT )?%\S+ = \w+\[([\d,]*)\]", line)
    if m and "parameter(" not in line and math.prod(
        int(d) for d in m.group(2).split(",") if d) >= layer_elems:
      big.append(line.strip()[:160])
  assert not big, big
  # The donated write's buffers, with XLA's default CPU pipeline: the suite's fast-compile
  # flags (tests/xla_cpu.py) pick emitters that copy a reshaped scatter operand, which a
  # production compile does not, so this part runs in a child process without them.
  child = subprocess.run([sys.executable, "-c", _WRITE_IN_PLACE, layout], capture_output=True,
                         text=True, timeout=300, env=dict(
                             os.environ, JAX_PLATFORMS="cpu",
                             XLA_FLAGS="--xla_force_host_platform_device_count=1"))
  assert child.returncode == 0, child.stderr[-2000:]


#: The child of test_the_compiled_reference_materializes_no_layer: a donated layered write
#: aliases the whole cache and makes no buffer a one-layer write of the same bytes does not.
_WRITE_IN_PLACE = """
import math, sys
import jax, jax.numpy as jnp
import kvjax
spec = kvjax.KVCacheSpec(2, 64, 16, "auto", sys.argv[1])
shape = spec.physical_shape(8, 4)
cache = jax.ShapeDtypeStruct(shape, spec.storage_dtype)
i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)
kv = jax.ShapeDtypeStruct((10, 2, 64), spec.dtype)
w = lambda c, k, v, s, l: kvjax.write_kv(c, k, v, s, spec, impl="reference", layer=l)
mem = jax.jit(w, donate_argnums=0).lower(cache, kv, kv, i32(10), i32()).compile()
mem = mem.memory_analysis()
assert mem.alias_size_in_bytes == math.prod(shape) * spec.itemsize, mem
flat = jax.ShapeDtypeStruct(spec.physical_shape(8 * 4), spec.storage_dtype)   # same bytes
w1 = lambda c, k, v, s: kvjax.write_kv(c, k, v, s, spec, impl="reference")
one = jax.jit(w1, donate_argnums=0).lower(flat, kv, kv, i32(10)).compile().memory_analysis()
assert mem.temp_size_in_bytes == one.temp_size_in_bytes, (mem, one)   # the layer adds none
"""


# -- errors --------------------------------------------------------------------------------------
def _ops(spec, cache, **kw):
  """The three ops on ``cache`` (small valid arguments), each a thunk."""
  slots = jnp.asarray([1, 2], jnp.int32)
  k = jnp.zeros((2, spec.num_kv_heads, spec.head_size), spec.dtype)
  q = jnp.zeros((2, 2 * spec.num_kv_heads, spec.head_size), spec.dtype)
  return [
      lambda: kvjax.write_kv(cache, k, k, slots, spec, **kw),
      lambda: kvjax.read_kv(cache, spec, slots, **kw),
      lambda: kvjax.unified_attention(q, cache, spec, query_start_loc=[0, 2], seq_lens=[2],
                                      block_table=[[0]], scale=1.0, **kw)]


def test_layered_cache_without_layer_is_refused():
  spec = KVCacheSpec(2, 32, 16, "auto", "HND")
  for op in _ops(spec, spec.allocate(B, num_layers=L)):
    with pytest.raises(ValueError, match=r"layered \(cross-layer\) array of 3 layers.*layer="):
      op()


@pytest.mark.parametrize("layer", [3, -1, np.int32(7), jnp.int32(3), np.asarray(-2)])
def test_a_concrete_layer_outside_the_stack_is_refused(layer):
  spec = KVCacheSpec(2, 32, 16, "auto", "NHD")
  for op in _ops(spec, spec.allocate(B, num_layers=L), layer=layer):
    with pytest.raises(ValueError, match=r"layer=-?\d+ is outside \[0, 3\)"):
      op()


@pytest.mark.parametrize("layer,err,match", [
    (True, TypeError, "layer must be an int"), (1.0, TypeError, "layer must be an int"),
    ("1", TypeError, "layer must be an int"),
    (jnp.asarray([1]), TypeError, "integer scalar, got shape"),
    (jnp.float32(1), TypeError, "integer scalar"),
])
def test_a_layer_of_the_wrong_kind_is_refused(layer, err, match):
  spec = KVCacheSpec(2, 32, 16, "auto", "NHD")
  for op in _ops(spec, spec.allocate(B, num_layers=L), layer=layer):
    with pytest.raises(err, match=match):
      op()


def test_layer_with_a_one_layer_cache_is_refused():
  spec = KVCacheSpec(2, 32, 16, "auto", "NHD")
  for op in _ops(spec, spec.allocate(B), layer=0):
    with pytest.raises(ValueError, match=r"layer=0 was given, but cache of shape .* is one "
                                         r"layer's 4-D cache"):
      op()


def test_a_wrong_layered_shape_names_the_expected_one():
  spec = KVCacheSpec(2, 32, 16, "auto", "NHD")
  wrong = KVCacheSpec(2, 32, 16, "auto", "HND").allocate(B, num_layers=L)  # (B, H, L, N, C)
  with pytest.raises(ValueError, match=r"not the spec's physical shape \(4, 2, 16, 2, 64\) "
                                       r"of 2 layers"):
    kvjax.read_kv(wrong, spec, [0], layer=0)


def test_nvfp4_has_no_layered_form():
  spec = KVCacheSpec(2, 32, 16, "nvfp4", "HND")
  for op in _ops(spec, spec.allocate(B, num_layers=L), layer=0):
    with pytest.raises(ValueError, match="nvfp4.*no layered .*form.*data \\| scales"):
      op()


def test_explain_says_kernels_pass_over_hnd_layered_caches():
  hnd = KVCacheSpec(2, 64, 16, "auto", "HND")
  choice = kvjax.explain("attention", hnd, platform="gpu", layered=True)
  assert choice.name == "xla"                # plain XLA ops read the layer slice
  assert "passed over pallas: a layer's page of a layered HND cache" in str(choice)
  assert kvjax.explain("attention", KVCacheSpec(2, 64, 16, "auto", "NHD"), platform="gpu",
                       layered=True).name == "pallas"
  assert kvjax.explain("write", hnd, platform="gpu", layered=True).name == "pallas"
