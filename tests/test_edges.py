"""Behaviour at the edges of the public API (docs/edges.md): bad input, hazards, contracts.

- ERRORS: bad input gets the exact exception type, and the message names the argument
  and shows the value. Each row runs eagerly and inside ``jax.jit`` (cache and q
  traced, the bad argument closed over, so value checks still run), with
  ``impl="reference"`` and ``impl="pallas"`` (interpret mode on CPU, compiled on a GPU with
  ``KVJAX_TEST_COMPILED=1``): every check runs before a kernel.
- Writes: slots past the end dropped (never wrapped) under jit, int64 slots never
  wrapped, NaN payloads of untouched blocks kept bit for bit, duplicate slots, int4 range.
- Attention under jit with invalid metadata: reference and kernels agree.
- Documented behaviours (NaN/Inf per format, nvfp4 global scale, read_kv under jit,
  ignored global scales) and the torch facade's edges.
"""
import dataclasses
import functools
import math
from typing import Tuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax import KVCacheSpec
from kv_testing import (as_bytes, assert_roundtrip, assert_written_as_reference, poisoned_cache,
                        random_kv)
from op_suite import triton_interpret

torch = pytest.importorskip("torch")
import torch_bridge as tb  # noqa: E402

H, HQ, D, N, B = 2, 4, 32, 16, 4
NUM_SLOTS = B * N
IMPLS = ("reference", "pallas")
#: The "pallas" implementation's mode: interpret on CPU, compiled on a GPU with
#: KVJAX_TEST_COMPILED=1 (tests/compiled_groups.py).
INTERPRET = triton_interpret()
I32_MAX = 2**31 - 1


def _spec(cache_dtype="auto", num_kv_heads=H, layout="NHD", dtype=jnp.bfloat16):
  return KVCacheSpec(num_kv_heads, D, N, cache_dtype,
                     "HND" if cache_dtype == "nvfp4" else layout, dtype)


# -- ERRORS ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Err:
  """One bad call: ``op`` with ``overrides`` on the base arguments must raise exactly ``exc``
  whose message contains every string of ``needles`` and none of ``absent``."""
  id: str
  op: str                                   # "write" | "read" | "attention"
  overrides: dict
  exc: type
  needles: Tuple[str, ...]
  cache_dtype: str = "auto"
  absent: Tuple[str, ...] = ()
  traceable: bool = True                    # False: the override is the traced argument itself


def _list_of(name):
  return lambda a: np.asarray(a[name], np.float32).tolist()


ERRORS = [
    # writes
    Err("slot past the end names slot and value", "write", {"slot_mapping": [1, 64, 3]},
        ValueError, ("slot_mapping[1] = 64", "num_blocks * block_size = 64")),
    Err("slot past the end, jax array", "write",
        {"slot_mapping": jnp.array([1, 2, 69], jnp.int32)}, ValueError, ("slot_mapping[2] = 69",)),
    Err("int64 slot beyond int32 is checked before narrowing", "write",
        {"slot_mapping": np.array([1, 2**32 + 7, 3], np.int64)}, ValueError,
        ("slot_mapping[1] = 4294967303",)),
    Err("spec that is not a KVCacheSpec", "write", {"spec": "auto"}, TypeError,
        ("spec must be a KVCacheSpec", "str 'auto'")),
    Err("numpy cache", "write", {"cache": lambda a: np.asarray(a["cache"])}, TypeError,
        ("cache must be a jax.Array", "ndarray"), traceable=False),
    Err("Python-list key", "write", {"key": _list_of("key")}, TypeError,
        ("key must be a jax.Array or numpy.ndarray", "got list")),
    Err("torch key", "write", {"key": lambda a: torch.zeros(3, H, D, dtype=torch.bfloat16)},
        TypeError, ("key must be", "torch.Tensor", "torch_bridge")),
    Err("torch slot_mapping", "write", {"slot_mapping": lambda a: torch.arange(3)}, TypeError,
        ("slot_mapping must be", "torch.Tensor")),
    Err("string k_scale", "write", {"k_scale": "abc"}, TypeError, ("k_scale", "str 'abc'"),
        cache_dtype="fp8"),
    Err("string k_scale where scales are ignored", "write", {"k_scale": "abc"}, TypeError,
        ("k_scale", "str 'abc'"), cache_dtype="int8_per_token_head"),
    Err("k_scale=+inf", "write", {"k_scale": math.inf}, ValueError,
        ("k_scale must be finite and positive", "k_scale = inf"), cache_dtype="fp8"),
    Err("k_scale=nan", "write", {"k_scale": jnp.float32(math.nan)}, ValueError,
        ("k_scale = nan",), cache_dtype="fp8"),
    Err("negative k_scale shows its value", "write", {"k_scale": -1.5}, ValueError,
        ("positive", "k_scale = -1.5"), cache_dtype="fp8_e5m2"),
    Err("per-head k_scale with an inf entry", "write",
        {"k_scale": jnp.array([0.5, math.inf], jnp.float32)}, ValueError, ("k_scale[1] = inf",),
        cache_dtype="fp8"),
    Err("nvfp4 v_scale=0", "write", {"v_scale": 0.0}, ValueError, ("v_scale = 0.0",),
        cache_dtype="nvfp4"),
    Err("float slot_mapping", "write", {"slot_mapping": jnp.zeros(3, jnp.float32)}, TypeError,
        ("slot_mapping must have an integer dtype", "float32")),
    Err("ragged list slot_mapping", "write", {"slot_mapping": [[1, 2], [3]]}, ValueError,
        ("slot_mapping must be a rectangular list",)),
    Err("key with the wrong heads", "write", {"key": lambda a: a["key"][:, :1]}, ValueError,
        ("key must have shape [T, 2, 32]", "(3, 1, 32)")),
    Err("value dtype", "write", {"value": lambda a: a["value"].astype(jnp.float32)}, TypeError,
        ("value dtype float32", "bfloat16")),
    Err("key shorter than slot_mapping", "write", {"key": lambda a: a["key"][:2]}, ValueError,
        ("key has 2 tokens", "len(slot_mapping)=3")),
    Err("cache of the wrong shape", "write", {"cache": lambda a: a["cache"][:, :, :1]},
        ValueError, ("cache shape (4, 16, 1, 64)", "physical shape")),
    Err("unknown impl", "write", {"impl": "triton"}, ValueError, ("impl='triton'",)),
    # reads
    Err("negative read slot names slots and value", "read", {"slots": [2, -1]}, ValueError,
        ("slots must be non-negative", "slots[1] = -1"), absent=("slot_mapping",)),
    Err("read slot past the end names slots", "read", {"slots": jnp.array([64], jnp.int32)},
        ValueError, ("slots[0] = 64",), absent=("slot_mapping",)),
    Err("read from a numpy cache", "read", {"cache": lambda a: np.asarray(a["cache"])},
        TypeError, ("cache must be a jax.Array",), traceable=False),
    Err("torch read slots", "read", {"slots": lambda a: torch.arange(2)}, TypeError,
        ("slots must be", "torch.Tensor")),
    # attention: metadata values (concrete)
    Err("block id past the cache inside the used range", "attention",
        {"block_table": [[0, 1], [4, 3]]}, ValueError,
        ("block_table[1, 0] = 4", "num_blocks=4")),
    Err("negative block id inside the used range", "attention",
        {"block_table": jnp.array([[0, 1], [2, -1]], jnp.int32)}, ValueError,
        ("block_table[1, 1] = -1",)),
    Err("query_start_loc not starting at 0", "attention", {"query_start_loc": [1, 3, 8]},
        ValueError, ("query_start_loc must start at 0", "query_start_loc[0] = 1")),
    Err("query_start_loc decreasing", "attention", {"query_start_loc": [0, 6, 5]}, ValueError,
        ("query_start_loc[1] = 6 > query_start_loc[2] = 5",)),
    Err("query_start_loc past T", "attention", {"query_start_loc": [0, 3, 9]}, ValueError,
        ("query_start_loc[2] = 9", "8 query tokens")),
    Err("seq_len shorter than the query", "attention", {"seq_lens": [5, 4]}, ValueError,
        ("seq_lens[1] = 4", "5 query tokens")),
    Err("negative seq_len", "attention", {"seq_lens": np.array([-1, 20], np.int64)},
        ValueError, ("seq_lens must be non-negative", "seq_lens[0] = -1")),
    Err("seq_len past capacity names the sequence", "attention", {"seq_lens": [5, 40]},
        ValueError, ("seq_lens[1] = 40", "2 blocks x 16 = 32")),
    Err("max_query_len below a query", "attention", {"max_query_len": 4}, ValueError,
        ("sequence 1 has 5 query tokens", "max_query_len=4")),
    Err("softmax scale nan", "attention", {"scale": math.nan}, ValueError, ("scale = nan",)),
    Err("softmax scale inf", "attention", {"scale": np.float32(math.inf)}, ValueError,
        ("scale must be finite", "scale = inf")),
    Err("string softmax scale", "attention", {"scale": "x"}, TypeError, ("scale", "str 'x'")),
    Err("soft_cap inf", "attention", {"soft_cap": math.inf}, ValueError, ("soft_cap", "inf")),
    Err("fp8 k_scale inf in attention", "attention", {"k_scale": math.inf}, ValueError,
        ("k_scale = inf",), cache_dtype="fp8"),
    # attention: types and shapes
    Err("Python-list q", "attention", {"q": _list_of("q")}, TypeError,
        ("q must be a jax.Array or numpy.ndarray", "got list")),
    Err("torch q", "attention", {"q": lambda a: torch.zeros(8, HQ, D)}, TypeError,
        ("q must be", "torch.Tensor")),
    Err("attention spec that is not a KVCacheSpec", "attention", {"spec": object()}, TypeError,
        ("spec must be a KVCacheSpec", "object")),
    Err("attention on a numpy cache", "attention", {"cache": lambda a: np.asarray(a["cache"])},
        TypeError, ("cache must be a jax.Array",), traceable=False),
    Err("ragged list block_table", "attention", {"block_table": [[0, 1], [2]]}, ValueError,
        ("block_table must be a rectangular list",)),
    Err("float seq_lens", "attention", {"seq_lens": jnp.array([5.0, 20.0])}, TypeError,
        ("seq_lens must have an integer dtype", "float32")),
    Err("sinks of the wrong shape", "attention", {"sinks": jnp.zeros(3)}, ValueError,
        ("sinks must have shape [4]", "(3,)")),
    Err("sliding_window 0", "attention", {"sliding_window": 0}, ValueError,
        ("sliding_window", "got 0")),
    Err("q heads not a multiple of H", "attention", {"q": lambda a: a["q"][:, :3]}, ValueError,
        ("q has 3 heads", "num_kv_heads=2")),
]


def _base_args(op, spec):
  cache = spec.allocate(B)
  if op == "write":
    kv = jnp.ones((3, spec.num_kv_heads, D), spec.dtype)
    return dict(cache=cache, key=kv, value=kv, slot_mapping=jnp.array([1, 2, 3], jnp.int32),
                spec=spec)
  if op == "read":
    return dict(cache=cache, spec=spec, slots=jnp.array([1, 2], jnp.int32))
  # two sequences: 3 query tokens of 5, and 5 of 20; T = 8, capacity 2 blocks x 16
  return dict(q=jnp.ones((8, HQ, D), jnp.bfloat16), cache=cache, spec=spec,
              query_start_loc=jnp.array([0, 3, 8], jnp.int32),
              seq_lens=jnp.array([5, 20], jnp.int32),
              block_table=jnp.array([[0, 1], [2, 3]], jnp.int32), scale=0.125)


def _call(op, args, impl):
  a = dict(args)
  if op == "read":
    return kvjax.read_kv(a.pop("cache"), a.pop("spec"), a.pop("slots"), **a)
  a.setdefault("impl", impl)
  a.setdefault("interpret", INTERPRET)
  if op == "write":
    return kvjax.write_kv(a.pop("cache"), a.pop("key"), a.pop("value"), a.pop("slot_mapping"),
                          a.pop("spec"), **a)
  return kvjax.unified_attention(a.pop("q"), a.pop("cache"), a.pop("spec"), **a)


def _error_params():
  for case in ERRORS:
    impls = ("reference",) if case.op == "read" else IMPLS
    for impl in impls:
      for mode in ("eager", "jit") if case.traceable else ("eager",):
        yield pytest.param(case, impl, mode, id=f"{case.id} [{impl}, {mode}]")


@pytest.mark.parametrize("case,impl,mode", list(_error_params()))
def test_bad_input_raises_a_clear_error(case: Err, impl, mode):
  args = _base_args(case.op, _spec(case.cache_dtype))
  for name, value in case.overrides.items():
    args[name] = value(args) if callable(value) else value
  traced = [n for n in ("cache", "q") if n in args and n not in case.overrides]

  def run():
    if mode == "eager":
      return _call(case.op, args, impl)
    return jax.jit(lambda *xs: _call(case.op, {**args, **dict(zip(traced, xs))}, impl))(
        *[args[n] for n in traced])

  with pytest.raises(Exception) as info:
    run()
  assert type(info.value) is case.exc, f"{type(info.value).__name__}: {info.value}"
  msg = str(info.value)
  for needle in case.needles:
    assert needle in msg, f"{needle!r} not in: {msg}"
  for word in case.absent:
    assert word not in msg, f"{word!r} in: {msg}"


@pytest.mark.parametrize("kwargs,exc,needles", [
    (dict(cache_dtype="nvfp4", layout="NHD"), ValueError, ("nvfp4", "'NHD'", "'HND'")),
    (dict(block_size=8), ValueError, ("block_size=8", "multiple of 16")),
    (dict(cache_dtype="int3"), ValueError, ("cache_dtype='int3'",)),
    (dict(head_size=30, cache_dtype="int4_per_token_head"), ValueError, ("head_size=30",)),
], ids=["nvfp4 NHD echoes the layout", "block_size", "unknown cache_dtype", "int4 head_size"])
def test_bad_spec_raises_a_clear_error(kwargs, exc, needles):
  args = dict(num_kv_heads=H, head_size=D, block_size=N) | kwargs
  with pytest.raises(Exception) as info:
    KVCacheSpec(**args)
  assert type(info.value) is exc
  for needle in needles:
    assert needle in str(info.value), str(info.value)


# -- shared compiled functions (one compile per spec and impl for the whole file) ---------------
T = 8        # tokens of every write below (slot mappings padded with -1)


@functools.lru_cache(maxsize=None)
def _jit_write(spec, impl):
  """write_kv jitted with the cache donated; k_scale/v_scale an argument (None or an array)."""
  return jax.jit(lambda c, k, v, s, ks: kvjax.write_kv(c, k, v, s, spec, k_scale=ks, v_scale=ks,
                                                        impl=impl, interpret=INTERPRET),
                 donate_argnums=0)


@functools.lru_cache(maxsize=None)
def _jit_read(spec):
  return jax.jit(lambda c, s, ks: kvjax.read_kv(c, spec, s, k_scale=ks, v_scale=ks))


@functools.lru_cache(maxsize=None)
def _jit_attention(spec, impl):
  return jax.jit(lambda q, c, qsl, sl, bt: kvjax.unified_attention(
      q, c, spec, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=0.125, impl=impl,
      interpret=INTERPRET))


def _write(mode, spec, impl, cache, key, value, slots, ks=None):
  """A write with ``T`` slots, eagerly or through :func:`_jit_write` (cache donated)."""
  if mode == "eager":
    return kvjax.write_kv(cache, key, value, slots, spec, k_scale=ks, v_scale=ks, impl=impl,
                          interpret=INTERPRET)
  return _jit_write(spec, impl)(cache, key, value, jnp.asarray(slots), ks)


def _slots(*named):
  return np.array(list(named) + [-1] * (T - len(named)), np.int32)


def _attention_batch(rng, spec):
  """The base two-sequence batch with every slot written with random K/V."""
  args = _base_args("attention", spec)
  key, value = random_kv(rng, spec, NUM_SLOTS)
  args["cache"] = _jit_write(spec, "reference")(poisoned_cache(rng, spec, B), key, value,
                                                jnp.arange(NUM_SLOTS, dtype=jnp.int32), None)
  args["q"] = jnp.asarray(rng.standard_normal((8, HQ, D)), jnp.bfloat16)
  return args


def _attend(args, impl):
  return np.asarray(_jit_attention(args["spec"], impl)(
      args["q"], args["cache"],
      *(jnp.asarray(args[k]) for k in ("query_start_loc", "seq_lens", "block_table"))),
                    np.float32)


# -- accepted inputs ---------------------------------------------------------------------------
def test_lists_are_accepted_for_all_integer_metadata(rng):
  """Lists work wherever an integer array goes (slot_mapping, slots, attention metadata),
  eagerly and as jit arguments."""
  spec = _spec()
  cache = poisoned_cache(rng, spec, B)
  key, value = random_kv(rng, spec, T)
  slots = _slots(5, 40, 2)
  want = kvjax.write_kv(cache, key, value, jnp.asarray(slots), spec)
  got = kvjax.write_kv(cache, key, value, slots.tolist(), spec)
  np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
  traced = jax.jit(kvjax.write_kv, static_argnums=4)(cache, key, value, slots.tolist(), spec)
  np.testing.assert_array_equal(as_bytes(traced), as_bytes(want))
  for a, b in zip(kvjax.read_kv(got, spec, [40, 5]), kvjax.read_kv(got, spec, jnp.array([40, 5]))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  args = _attention_batch(rng, spec)
  as_lists = {k: np.asarray(args[k]).tolist()
              for k in ("query_start_loc", "seq_lens", "block_table")}
  out = kvjax.unified_attention(**{**args, **as_lists}, impl="reference")
  np.testing.assert_allclose(np.asarray(out, np.float32), _attend(args, "reference"),
                             rtol=1e-2, atol=1e-2)


def test_block_table_entries_past_the_used_range_are_not_read(rng):
  """Padding columns may hold anything (-1, huge ids): only the first cdiv(seq_len, N)
  entries of a row are checked, and only those are read."""
  spec = _spec()
  args = _attention_batch(rng, spec)              # sequence 0 (5 tokens) uses column 0 only
  for padding in (-1, 2**40, B):
    bt = np.array([[0, padding], [2, 3]], np.int64)
    kvjax.attention.check_attention_args(args["q"], args["cache"], spec,
                                         args["query_start_loc"], args["seq_lens"], bt,
                                         None, None, None)
  for impl in IMPLS:
    want = _attend(args, impl)
    got = _attend({**args, "block_table": [[0, -1], [2, 3]]}, impl)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("cache_dtype", ["auto", "int8_per_token_head"])
def test_formats_without_global_scales_ignore_k_and_v_scale(rng, cache_dtype):
  """vLLM passes k_scale/v_scale (default 1.0) to every backend: plain and per-token-head
  caches ignore their values (their type is still checked)."""
  spec = _spec(cache_dtype)
  cache = poisoned_cache(rng, spec, B)
  key, value = random_kv(rng, spec, T)
  slots = _slots(3, 17, 50)
  want = kvjax.write_kv(cache, key, value, slots, spec)
  for impl in IMPLS:
    got = kvjax.write_kv(cache, key, value, slots, spec, k_scale=7.0, v_scale=jnp.float32(-3.0),
                         impl=impl, interpret=INTERPRET)
    assert_written_as_reference(got, want, spec, slots)
  for a, b in zip(kvjax.read_kv(want, spec, slots[:3], k_scale=7.0, v_scale=0.25),
                  kvjax.read_kv(want, spec, slots[:3])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# -- writes: bit-level contracts ---------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("num_kv_heads,bad", [
    (2, [64, 69, I32_MAX, 2**31 - 16]),
    (4, [2**30 + 5, 2**30 + 64, 2**29 + 7]),      # slot * H wraps int32 onto slots 5, 0, 7
], ids=["H2", "H4 wrap"])
def test_slots_past_the_end_are_dropped_under_jit(rng, impl, num_kv_heads, bad):
  """Item 1: every slot outside [0, B*N) writes nothing, whatever slot * H wraps to
  (eagerly such slots raise: see ERRORS)."""
  spec = _spec(num_kv_heads=num_kv_heads)
  cache = poisoned_cache(rng, spec, B)
  before = as_bytes(cache).copy()
  key, value = random_kv(rng, spec, T)
  slots = _slots(9, *bad, 30)
  want = kvjax.write_kv(cache, key, value, np.where(np.isin(slots, [9, 30]), slots, -1), spec)
  got = _write("jit", spec, impl, cache, key, value, slots)
  np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
  assert not np.array_equal(as_bytes(want), before)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_int64_slots_are_never_wrapped(rng, impl, mode):
  """Item 2: an int64 slot below int32's range is a skip (not slot 5); the range is checked
  before any narrowing. Under jit the int64 array is closed over (JAX itself narrows int64
  jit *arguments* by wrapping when x64 is off: see docs/edges.md)."""
  spec = _spec()
  cache = poisoned_cache(rng, spec, B)
  key, value = random_kv(rng, spec, T)
  slots = np.array([-(2**32) + 5, 7, -(2**33) + 9, -(2**63)] + [-1] * (T - 4), np.int64)
  want = kvjax.write_kv(cache, key, value, _slots(-1, 7), spec)
  fn = lambda c: kvjax.write_kv(c, key, value, slots, spec, impl=impl, interpret=INTERPRET)
  got = fn(cache) if mode == "eager" else jax.jit(fn)(cache)
  np.testing.assert_array_equal(as_bytes(got), as_bytes(want))


def test_jax_wraps_int64_jit_arguments_without_x64():
  """The hazard docs/edges.md warns about: outside kvjax's reach, so pass int32 slots."""
  if jax.config.jax_enable_x64:
    pytest.skip("x64 keeps int64 arguments")
  out = jax.jit(lambda s: s)(np.array([-(2**32) + 5], np.int64))
  assert out.dtype == jnp.int32 and int(out[0]) == 5


def _nan_payload_cache(rng, spec):
  """Random bytes with one element in eight a NaN of an assorted (non-canonical) payload."""
  raw = rng.integers(0, 256, B * spec.page_bytes, dtype=np.uint8)
  nan_bits = {1: [0x7D, 0xFD, 0x7E, 0xFF], 2: [0x7FC1, 0xFF81, 0x7F81],
              4: [0x7FC00001, 0xFF800003, 0x7F800100]}[spec.itemsize]
  elems = raw.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[spec.itemsize])
  idx = rng.choice(elems.size, elems.size // 8, replace=False)
  elems[idx] = rng.choice(np.array(nan_bits, elems.dtype), idx.size)
  return jnp.asarray(raw.view(spec.storage_dtype).reshape(spec.physical_shape(B)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
@pytest.mark.parametrize("cache_dtype", ["fp8_e5m2", "bfloat16", "float32"])
def test_untouched_nan_payloads_keep_their_bits(rng, impl, mode, cache_dtype):
  """Item 4: a write rewrites only the rows it names, even among NaN payloads."""
  spec = _spec(cache_dtype)
  cache = _nan_payload_cache(rng, spec)
  rows_before = np.asarray(kvjax.token_major(cache, spec)).view(np.uint8).copy()
  key, value = random_kv(rng, spec, T)
  slots = _slots(17, 3, 20, 60)
  got = _write(mode, spec, impl, cache, key, value, slots,
               jnp.float32(0.5) if spec.format.has_tensor_scales else None)
  rows_after = np.asarray(kvjax.token_major(got, spec)).view(np.uint8)
  written = np.zeros((B, N), bool)
  named = slots[slots >= 0]
  written[named // N, named % N] = True
  np.testing.assert_array_equal(rows_after[~written], rows_before[~written])
  assert (rows_after[written] != rows_before[written]).any(axis=(-2, -1)).all()


@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_duplicate_slots_last_token_wins_in_the_reference(rng, mode):
  """docs/edges.md: the reference keeps the last token written to a slot (Pallas kernels
  on a GPU: undefined, tokens race)."""
  spec = _spec("int8_per_token_head")
  cpu = jax.devices("cpu")[0]     # the contract is the CPU's (also on a GPU machine)
  cache = jax.device_put(poisoned_cache(rng, spec, B), cpu)
  key, value = (jax.device_put(x, cpu) for x in random_kv(rng, spec, T))
  last = jnp.array([3, 1] + [0] * (T - 2))
  want = kvjax.write_kv(cache, key[last], value[last], _slots(9, 40), spec, impl="reference")
  got = _write(mode, spec, "reference", cache, key, value, _slots(9, 40, 9, 9))
  np.testing.assert_array_equal(as_bytes(got), as_bytes(want))


def _int4_rows_at_the_rotation_limit(rng, shape):
  """float32 rows whose magnitudes sum to 2**126, the largest int4 reads back finite (the
  rotation sums D values, and max - min of the rotated row must stay finite)."""
  x = rng.uniform(-1, 1, shape)
  x[..., 0], x[..., 1] = 1.0, -1.0
  return (x / np.abs(x).sum(-1, keepdims=True) * 2.0**126).astype(np.float32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_int4_rows_at_the_rotation_limit_read_back_finite(rng, impl, mode):
  """Item 9 (docs/edges.md): rows with sum |x| <= 2**126 read back finite, within int4's bound."""
  spec = _spec("int4_per_token_head", layout="HND", dtype=jnp.float32)
  x = _int4_rows_at_the_rotation_limit(rng, (T, H, D))
  slots = _slots(4, 33)
  got = _write(mode, spec, impl, spec.allocate(B), jnp.asarray(x), jnp.asarray(x), slots)
  for back in _jit_read(spec)(got, jnp.asarray(slots[:2]), None):
    back = np.asarray(back)
    assert np.isfinite(back).all()
    assert_roundtrip(spec, x[:2], back)


def test_int4_clips_a_row_that_rotates_to_a_constant(rng):
  """docs/edges.md: zp is clamped to [0, 15] (as in vLLM), so (5, 0, ..., 0), which rotates to
  a constant row, reads back (1.5e-5, 0, ..., 0); its neighbours are unaffected."""
  spec = _spec("int4_per_token_head", dtype=jnp.float32)
  x = rng.standard_normal((T, H, D)).astype(np.float32)
  x[0, 0] = 0.0
  x[0, 0, 0] = 5.0
  slots = _slots(4, 33)
  cache = _write("jit", spec, "reference", spec.allocate(B), jnp.asarray(x), jnp.asarray(x), slots)
  k = np.asarray(_jit_read(spec)(cache, jnp.asarray(slots[:2]), None)[0])
  np.testing.assert_allclose(k[0, 0, 0], 1.5e-5, rtol=1e-5)
  assert not k[0, 0, 1:].any()
  assert_roundtrip(spec, x[:2, 1], k[:, 1])
  assert_roundtrip(spec, x[1:2], k[1:2])


# -- jit without static_argnums (item 10) ------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_public_ops_jit_with_the_spec_as_an_argument(rng, impl):
  """jax.jit(kvjax.write_kv) and jax.jit(kvjax.unified_attention) with no static_argnums."""
  spec = _spec("fp8")
  cache = poisoned_cache(rng, spec, B)
  key, value = random_kv(rng, spec, T)
  slots = jnp.asarray(_slots(2, 21, 47))
  ks = jnp.float32(0.5)
  write = jax.jit(functools.partial(kvjax.write_kv, impl=impl, interpret=INTERPRET))
  got = write(cache, key, value, slots, spec, k_scale=ks, v_scale=ks)
  want = kvjax.write_kv(cache, key, value, slots, spec, k_scale=ks, v_scale=ks)
  np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
  args = _attention_batch(rng, _spec())
  attend = jax.jit(functools.partial(kvjax.unified_attention, impl=impl, interpret=INTERPRET))
  out = attend(args["q"], args["cache"], args["spec"], scale=0.125,        # a traced scale
               **{k: args[k] for k in ("query_start_loc", "seq_lens", "block_table")})
  np.testing.assert_allclose(np.asarray(out, np.float32), _attend(args, "reference"),
                             rtol=2e-2, atol=2e-2)


# -- attention under jit with invalid metadata: reference and kernels agree (item 6) -------------
INVALID_METADATA = {
    "block id past the cache": dict(block_table=[[0, 1], [7, 3]]),
    "negative block id": dict(block_table=[[-1, 1], [2, 3]]),
    "query_start_loc not from 0": dict(query_start_loc=[2, 3, 8]),
    "query_start_loc decreasing": dict(query_start_loc=[0, 6, 5]),
    "query_start_loc past T": dict(query_start_loc=[0, 3, 11]),
    "seq_len below the query": dict(seq_lens=[1, 20]),
    "negative seq_len": dict(seq_lens=[-4, 20]),
    "seq_len past capacity": dict(seq_lens=[5, 45]),
}


def test_invalid_metadata_under_jit_reference_and_kernels_agree(rng):
  args = _attention_batch(rng, _spec())
  for name, bad in INVALID_METADATA.items():
    ref, pallas = (_attend({**args, **bad}, impl) for impl in IMPLS)
    np.testing.assert_allclose(pallas, ref, rtol=2e-2, atol=2e-2, equal_nan=True, err_msg=name)


# -- documented behaviours (docs/edges.md) -----------------------------------------------------
def test_read_kv_under_jit_reads_nan_for_invalid_slots(rng):
  spec = _spec("fp8_per_token_head")
  key, value = random_kv(rng, spec, NUM_SLOTS)
  cache = kvjax.write_kv(spec.allocate(B), key, value, jnp.arange(NUM_SLOTS), spec)
  k, v = _jit_read(spec)(cache, jnp.array([3, -1, 64, I32_MAX, 0], jnp.int32), None)
  k_ok, v_ok = kvjax.read_kv(cache, spec, jnp.array([3, 0]))
  for got, ok in ((k, k_ok), (v, v_ok)):
    got = np.asarray(got)
    assert np.isnan(got[1:4]).all()
    np.testing.assert_array_equal(got[[0, 4]], np.asarray(ok))


@pytest.mark.parametrize("impl", IMPLS)
def test_nvfp4_small_data_needs_a_global_scale(rng, impl):
  """With k_scale = 1, a 16-element group whose amax is below ~0.006 stores all zeros; a
  global scale of amax / (6 * 448) keeps it."""
  spec = _spec("nvfp4", dtype=jnp.float32)
  x = rng.standard_normal((T, H, D)).astype(np.float32)
  x *= 5e-3 / np.abs(x).max()                                  # amax 0.005
  key, slots = jnp.asarray(x), _slots(1, 2, 3, 4, 5, 6, 7, 8)
  read = lambda c, ks: np.asarray(_jit_read(spec)(c, jnp.asarray(slots), ks)[0])
  one = jnp.float32(1.0)
  assert not read(_write("jit", spec, impl, spec.allocate(B), key, key, slots, one), one).any()
  gs = jnp.float32(np.abs(x).max() / (6 * 448))
  assert_roundtrip(spec, x, read(_write("jit", spec, impl, spec.allocate(B), key, key, slots, gs),
                                 gs))


# -- the torch facade and bridge ---------------------------------------------------------------
def _backend(cache_dtype="auto", **kw):
  return tb.PagedAttentionBackend(HQ, H, D, N, cache_dtype, **kw)


def _physical_bytes(t, spec):
  return tb.physical_tensor(t, spec).contiguous().reshape(-1).view(torch.uint8).numpy().copy()


def _bf16(rng, shape):
  return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).bfloat16()


def test_facade_int64_slots_never_wrap_and_capacity_is_checked(rng):
  """Items 3 and 7: do_kv_cache_update checks a host slot mapping before narrowing it."""
  backend = _backend()
  spec = backend.spec
  cache = backend.allocate_kv_cache(B)
  tb.physical_tensor(cache, spec).reshape(-1).view(torch.uint8).copy_(
      torch.from_numpy(as_bytes(poisoned_cache(rng, spec, B)).reshape(-1).copy()))
  key, value = _bf16(rng, (3, H, D)), _bf16(rng, (3, H, D))
  want = kvjax.write_kv(tb.from_torch(cache, spec), jnp.asarray(key.float().numpy(), jnp.bfloat16),
                        jnp.asarray(value.float().numpy(), jnp.bfloat16),
                        jnp.array([-1, 7, -1], jnp.int32), spec)
  want = as_bytes(want).reshape(-1).copy()
  backend.do_kv_cache_update(key, value, cache, torch.tensor([-(2**32) + 5, 7, -(2**40)]))
  np.testing.assert_array_equal(_physical_bytes(cache, spec), want)
  for bad in ([3, 2**32 + 7], [64, 1]):
    with pytest.raises(ValueError) as info:
      backend.do_kv_cache_update(key[:2], value[:2], cache, torch.tensor(bad))
    assert f"slot_mapping[{bad.index(max(bad))}] = {max(bad)}" in str(info.value)
  np.testing.assert_array_equal(_physical_bytes(cache, spec), want)


def _metadata(**over):
  base = dict(query_start_loc=torch.tensor([0, 3, 8], dtype=torch.int32),
              seq_lens=torch.tensor([5, 20], dtype=torch.int32),
              block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
              slot_mapping=torch.arange(8, dtype=torch.int32), max_query_len=5, max_seq_len=20)
  base.update({k: torch.tensor(v) if isinstance(v, list) else v for k, v in over.items()})
  return tb.PagedAttentionMetadata(**base)


@pytest.mark.parametrize("over,needle", [
    (dict(block_table=[[0, 1], [9, 3]]), "block_table[1, 0] = 9"),
    (dict(query_start_loc=[0, 6, 5]), "query_start_loc[1] = 6 > query_start_loc[2] = 5"),
    (dict(seq_lens=[5, 2**33]), "seq_lens[1] = 8589934592"),
    (dict(seq_lens=[2, 20]), "seq_lens[0] = 2"),
    (dict(max_query_len=2), "max_query_len=2"),
], ids=["block id", "query_start_loc", "int64 seq_len", "seq_len < query", "max_query_len"])
def test_facade_forward_checks_cpu_metadata(rng, over, needle):
  """Item 7: the facade runs under jit, so it checks CPU metadata itself (once per metadata)."""
  backend = _backend()
  cache = backend.allocate_kv_cache(B)
  q = _bf16(rng, (8, HQ, D))
  out = torch.zeros_like(q)
  with pytest.raises(ValueError) as info:
    backend.forward(q, cache, _metadata(**over), out)
  assert needle in str(info.value)
  assert not out.any()


def test_facade_rejects_non_finite_scales(rng):
  """Item 8 through the facade: softmax scale and soft cap at construction, k_scale per call."""
  for kw, needle in ((dict(scale=math.nan), "scale = nan"), (dict(soft_cap=math.inf), "soft_cap")):
    with pytest.raises(ValueError, match=needle):
      _backend(**kw)
  backend = _backend("fp8")
  cache = backend.allocate_kv_cache(B)
  key = _bf16(rng, (2, H, D))
  for ks, needle in ((math.inf, "k_scale = inf"), (torch.tensor([-2.0]), "k_scale = -2.0")):
    with pytest.raises(ValueError) as info:
      backend.do_kv_cache_update(key, key, cache, torch.tensor([1, 2]), k_scale=ks)
    assert needle in str(info.value)
  assert not cache.any()


def test_from_torch_refuses_a_contiguous_tensor_that_fits_both_readings(rng):
  """Item 5: NHD with num_kv_heads == block_size: logical and physical shapes coincide."""
  spec = KVCacheSpec(16, D, 16, "auto", "NHD")
  logical = tb.empty_cache(spec, 2)                  # vLLM's view: permuted, unambiguous
  logical.copy_(_bf16(rng, tuple(logical.shape)))
  assert tb.from_torch(logical, spec).unsafe_buffer_pointer() == logical.data_ptr()
  phys = tb.physical_tensor(logical, spec)
  contiguous = logical.contiguous()                  # same shape as phys, heads/tokens swapped
  assert contiguous.shape == phys.shape and contiguous.stride() == phys.stride()
  for t in (phys, contiguous):
    with pytest.raises(ValueError) as info:
      tb.from_torch(t, spec)
    assert "ambiguous" in str(info.value) and "view='physical'" in str(info.value)
  j = tb.from_torch(phys, spec, view="physical")
  assert j.unsafe_buffer_pointer() == phys.data_ptr()
  np.testing.assert_array_equal(np.asarray(j.astype(jnp.float32)),
                                logical.permute(0, 2, 1, 3).float().numpy())
  with pytest.raises(ValueError, match="view='logical'"):
    tb.from_torch(phys, spec, view="logical")
  with pytest.raises(ValueError, match="view="):
    tb.from_torch(phys, spec, view="HND")


def test_facade_refuses_a_cache_whose_storage_was_freed(rng):
  """A storage resized in place frees the memory imported JAX arrays point at."""
  backend = _backend()
  cache = backend.allocate_kv_cache(B)
  key = _bf16(rng, (2, H, D))
  backend.do_kv_cache_update(key, key, cache, torch.tensor([1, 2]))
  cache.untyped_storage().resize_(0)
  with pytest.raises(ValueError, match="storage was resized or freed"):
    backend.do_kv_cache_update(key, key, cache, torch.tensor([1, 2]))
  with pytest.raises(ValueError, match="storage was resized or freed"):
    backend.forward(_bf16(rng, (8, HQ, D)), cache, _metadata(), torch.zeros(8, HQ, D,
                                                                            dtype=torch.bfloat16))


def test_donating_a_cache_torch_views_copies_on_cpu(rng):
  """docs/edges.md: on CPU, donating a JAX cache that to_torch shared is not honoured: the
  write goes to a new buffer and the torch tensor keeps the old bytes."""
  spec = _spec()
  cpu = jax.devices("cpu")[0]
  cache = jax.device_put(poisoned_cache(rng, spec, B), cpu)
  t = tb.to_torch(cache, spec)
  before = _physical_bytes(t, spec)
  key, value = random_kv(rng, spec, 2)
  new = jax.jit(kvjax.write_kv, static_argnums=4, donate_argnums=0)(
      cache, key, value, jnp.array([1, 2], jnp.int32), spec)
  assert new.unsafe_buffer_pointer() != t.data_ptr()
  assert not cache.is_deleted()
  np.testing.assert_array_equal(_physical_bytes(t, spec), before)
  np.testing.assert_array_equal(as_bytes(cache).reshape(-1), before)
  assert not np.array_equal(as_bytes(new).reshape(-1), before)
