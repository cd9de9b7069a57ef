"""Shared machinery of the per-op case suites (test_op_write / test_op_attention / test_op_read).

Every case runs on every implementation registered for the op (``kvjax.registry``), the
test-only toy backend included:

- by default (CPU CI) an implementation native to the platform runs as is (the reference),
  a Pallas kernel in interpret mode;
- with ``KVJAX_TEST_COMPILED=1`` (the GPU machine) implementations run compiled, and those
  that do not run compiled on this platform are skipped (so on a CPU the kernels skip).

Cases may use the test-only toy format (tests/toy_format.py) through the ``toy_format``
fixture, which adds its one table line for the test's duration.
"""
import os

import pytest

from kvjax import formats, registry
from toy_format import TOY

COMPILED = os.environ.get("KVJAX_TEST_COMPILED", "") == "1"
TOY_BACKEND = "toy_dense"

if TOY_BACKEND not in registry.ATTENTION.names():
  registry.ATTENTION.register(TOY_BACKEND, "toy_backend:unified_attention",
                              supports="toy_backend:supports_attention")


def implementations(op: str, but=()):
  """pytest params: one per implementation of ``op`` (names of ``kvjax.registry``), except
  those named in ``but``."""
  return [pytest.param(name, id=name) for name in registry.REGISTRIES[op].names()
          if name not in but]


def run_mode(op: str, name: str, *supports_args) -> bool:
  """``interpret`` for implementation ``name`` of ``op`` under the suite's mode; skips the test
  when the implementation cannot run that way here, or does not support the call
  (``supports_args``: what the op's supports functions take, e.g. (spec, q_dtype))."""
  impl = registry.REGISTRIES[op].get(name)
  why = impl.reason(*supports_args) if supports_args else None
  if why is not None:
    pytest.skip(f"{name}: {why}")
  native = registry.platform() in impl.platforms
  if COMPILED:
    if not native:
      pytest.skip(f"{name} runs compiled on {'/'.join(impl.platforms)}, not "
                  f"{registry.platform()} (KVJAX_TEST_COMPILED=1)")
    return False
  if native:
    return False
  if not impl.interpretable:
    pytest.skip(f"{name} runs on {'/'.join(impl.platforms)} only")
  return True


def triton_interpret() -> bool:
  """``interpret`` for a test module that calls a Triton kernel directly: interpret mode by
  default, compiled with ``KVJAX_TEST_COMPILED=1`` (the module skips unless on a GPU)."""
  if not COMPILED:
    return True
  if registry.platform() != "gpu":
    pytest.skip("the Triton kernels run compiled on a GPU only", allow_module_level=True)
  return False


def mosaic_gpu_numerics(test):
  """Marks a numerics test that calls a Mosaic GPU kernel directly with ``interpret=not
  COMPILED``.

  By default it runs in Mosaic GPU interpret mode: skipped on jax < 0.11 (its interpreter
  lacks out-of-bounds TMA reads and transposed wgmma operands) and marked ``mosaic_interpret``
  (minutes each on a GPU host's CPU: ``-m "not mosaic_interpret"`` leaves them out). With
  ``KVJAX_TEST_COMPILED=1`` it runs compiled, skipped unless the kernels run here (jax >= 0.11,
  an sm90+ GPU)."""
  from pallas_kernels.mosaic_gpu import ragged_attention as mgpu
  if COMPILED:
    why = mgpu.platform_reason()
    return pytest.mark.skipif(why is not None, reason=f"compiled Mosaic GPU: {why}")(test)
  skip = pytest.mark.skipif(mgpu.JAX_VERSION < mgpu.MIN_JAX, reason="Mosaic GPU interpret "
                            "mode of jax < 0.11 lacks OOB TMA reads and transposed wgmma "
                            "operands")
  return pytest.mark.mosaic_interpret(skip(test))


def exact_bytes(name: str, interpret: bool) -> bool:
  """Whether an implementation's writes must equal the reference's bytes: always in interpret
  mode; compiled kernels may differ from XLA's compile of the reference on rounding
  boundaries of the per-token-head quantizers (benchmarks/RESULTS.md, "Writes")."""
  return name == "reference" or interpret


#: What a registered implementation does not do yet, per (op, implementation, check): the
#: suite runs the check and expects it to fail (``xfail``), so a fix shows as XPASS.
KNOWN_GAPS = {}


def known_gap(request, op: str, name: str, check: str, strict: bool = True):
  """Mark the running test as an expected failure where :data:`KNOWN_GAPS` says so."""
  why = KNOWN_GAPS.get((op, name, check))
  if why is not None:
    request.node.add_marker(pytest.mark.xfail(reason=f"{name} {why}", strict=strict))


@pytest.fixture
def toy_format():
  """Adds the toy format's table line to kvjax.formats.CACHE_FORMATS for one test."""
  formats.CACHE_FORMATS[TOY.name] = TOY
  yield TOY
  del formats.CACHE_FORMATS[TOY.name]
