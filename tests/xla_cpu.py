"""XLA flags of the CPU test runs (no jax import here: conftest applies them before jax starts).

Interpret-mode Pallas kernels and the jitted references are large XLA programs: on CPU the
suite spends most of its time compiling them, not running them. Two flags make those compiles
2-3x cheaper, and the tests' shapes are small enough that the slower code costs nothing:

- ``--xla_backend_optimization_level=0``: LLVM at -O0;
- ``--xla_cpu_use_fusion_emitters=false``: XLA:CPU's elemental emitters instead of its newer
  MLIR fusion emitters.

XLA's own graph passes (where it rewrites ``x / c`` as ``x * (1/c)``, say) run as before and no
fast-math is enabled; both sides of every comparison (reference and kernel, eager and jit) are
built with the same flags. An XLA that does not know a flag aborts the process, so the flags
are tried once in a child process and the run keeps those this jaxlib accepts
(:func:`fast_compile_flags`). Compiled-mode runs on a GPU
(``KVJAX_TEST_COMPILED=1 JAX_PLATFORMS=cuda,cpu``) are left alone.
"""
import os
import subprocess
import sys

CANDIDATE_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
_ENV = "KVJAX_TEST_FAST_XLA_FLAGS"     # the probed flags, for xdist workers and child processes


def _accepted(flags: str) -> bool:
  probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                         env=dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu"),
                         capture_output=True, timeout=300)
  return probe.returncode == 0


def fast_compile_flags() -> str:
  """The candidate flags this jaxlib accepts (probed once per run, then read from the
  environment)."""
  if _ENV not in os.environ:
    flags = " ".join(CANDIDATE_FLAGS)
    if not _accepted(flags):
      flags = " ".join(f for f in CANDIDATE_FLAGS if _accepted(f))
    os.environ[_ENV] = flags
  return os.environ[_ENV]


def with_fast_compiles(flags: str) -> str:
  """``flags`` (an XLA_FLAGS value) plus :func:`fast_compile_flags` not already set there."""
  extra = [f for f in fast_compile_flags().split() if f.split("=")[0] not in flags]
  return " ".join([flags] + extra).strip()


def subprocess_env(**extra) -> dict:
  """The environment of an example or snippet run as a child process: CPU, one device (as a
  newcomer's machine has), fast compiles, ``extra`` on top."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=fast_compile_flags())
  env.update(extra)
  return env
