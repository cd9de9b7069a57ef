"""Test setup: 8 simulated CPU devices (for sharding and transfer tests), fast CPU compiles
(tests/xla_cpu.py) and one compilation cache per run, a seeded ``rng`` fixture, and a clean end
of xdist workers."""
import os
import shutil
import signal
import tempfile
import threading

from xla_cpu import with_fast_compiles

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_RUN_CACHE_DIR = None
if os.environ["JAX_PLATFORMS"] == "cpu":
  os.environ["XLA_FLAGS"] = with_fast_compiles(os.environ["XLA_FLAGS"])
  # Tests build equal programs again and again (a fresh jit of the same reference or kernel on
  # the same shapes in another test, another xdist worker, an example's process): JAX's
  # persistent compilation cache in a directory of this run compiles each once. It is made
  # empty here, before the xdist workers start (they and every child process inherit the
  # variable), and removed at the end, so no run reuses another's programs.
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _RUN_CACHE_DIR = tempfile.mkdtemp(prefix="kvjax-test-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _RUN_CACHE_DIR
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture
def rng():
  """A fresh numpy Generator per test; its seed is printed (shown when the test fails).

  Set KVJAX_TEST_SEED to replay a failure.
  """
  seed = int(os.environ.get("KVJAX_TEST_SEED", np.random.SeedSequence().entropy % 2**32))
  print(f"rng seed = {seed} (replay with KVJAX_TEST_SEED={seed})")
  return np.random.default_rng(seed)


def pytest_sessionfinish(session):
  """An xdist worker ignores SIGINT once its results are sent.

  At the end of a run xdist asks each worker's execnet gateway to exit; execnet waits 5 s for
  the worker's main thread and then sends the worker a SIGINT. A worker of this suite may
  still be tearing down then (pytest's final ``gc.collect()`` passes over a heap of compiled
  programs, slow on a busy machine), and the KeyboardInterrupt lands in whatever Python code
  runs next: during a collection that is a gc callback -- hypothesis installs one to time
  garbage collection -- and Python reports an exception in a gc callback as "unraisable",
  which pytest prints as a ``PytestUnraisableExceptionWarning`` with a KeyboardInterrupt
  traceback. Ignoring SIGINT from here on lets the teardown finish (execnet still ends a worker
  that hangs, with ``os._exit`` after 10 more seconds); every result has been reported by now.
  """
  if (hasattr(session.config, "workerinput")
      and threading.current_thread() is threading.main_thread()):
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def pytest_unconfigure(config):
  if _RUN_CACHE_DIR is not None:                 # the process that made it (xdist's controller)
    shutil.rmtree(_RUN_CACHE_DIR, ignore_errors=True)
