"""kvjax.registry: which implementation runs each op, on which platform, and why."""
import jax.numpy as jnp
import pytest

import kvjax
from kvjax import registry

SPEC = kvjax.KVCacheSpec(num_kv_heads=2, head_size=64, block_size=16)


@pytest.mark.parametrize("op", ["write", "attention", "read"])
def test_auto_per_platform(op):
  """auto: the reference on CPU (never an interpret-mode kernel), the Triton kernels on GPU,
  and on a TPU the reference until a TPU backend registers (never a Triton kernel)."""
  cpu = kvjax.explain(op, SPEC, platform="cpu")
  assert (cpu.name, cpu.interpret) == ("reference", False)
  assert ("pallas", "runs compiled on gpu, not cpu") in cpu.skipped
  gpu = kvjax.explain(op, SPEC, platform="gpu")
  assert (gpu.name, gpu.interpret, gpu.skipped) == ("pallas", False, ())
  tpu = kvjax.explain(op, SPEC, platform="tpu")
  assert tpu.name != "pallas"
  assert str(cpu).startswith(f"{op} on cpu: reference (compiled)")


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
  assert kvjax.explain("attention", SPEC, jnp.int8, platform="gpu").skipped[0][0] == "pallas"
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
