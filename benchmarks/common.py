"""Shared benchmark helpers: timing (JAX and torch), the device copy ceiling, versions, where
results go, and the smoke-run notice.

Timing rules: warm up first (compilation out of the numbers), repeat, report the median. JAX
work is timed on the host around ``block_until_ready`` of a batch of back-to-back calls
(dispatch is asynchronous, so the batch keeps the GPU busy); torch work with CUDA events
through ``triton.testing.do_bench`` when available.
"""
from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time


def time_jax(fn, *args, reps: int = 7, inner: int = 10, warmup: int = 2) -> float:
  """Median milliseconds of one ``fn(*args)`` call (``fn`` jitted), batched ``inner`` per sample."""
  import jax
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = None
    for _ in range(inner):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t0) / inner * 1e3)
  return statistics.median(samples)


def time_jax_chained(step, x0, *rest, chain: int = 3, reps: int = 5, inner: int = 5) -> float:
  """Median milliseconds of one ``step(x, *rest) -> x'`` (same shape and dtype as x).

  ``chain`` steps run back to back inside one jitted program, each feeding the next (a
  decode step's output is the next query), so per-call dispatch cost on the host is
  amortized and hidden behind GPU work; the result is the program time / chain.
  """
  return time_jax(chained(step, chain), x0, *rest, reps=reps, inner=inner, warmup=1) / chain


def chained(step, chain: int):
  """``step`` run ``chain`` times back to back in one jitted program, each output the next
  input: ``(x, *rest) -> x``."""
  import jax

  def run(x, *r):
    for _ in range(chain):
      x = step(x, *r)
    return x
  return jax.jit(run)


def time_torch(fn, warmup_ms: int = 25, rep_ms: int = 100) -> float:
  """Median milliseconds of ``fn()`` (CUDA events via triton's do_bench; host clock on CPU)."""
  import torch
  if torch.cuda.is_available():
    try:
      from triton.testing import do_bench
      return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    except ImportError:
      pass
  fn()
  samples = []
  for _ in range(5):
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_available():
      torch.cuda.synchronize()
    samples.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(samples)


def device_copy_tb_s(nbytes: int = 2 << 30) -> float:
  """Device-to-device copy rate, TB/s counting bytes read plus bytes written (torch)."""
  import torch
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  if dev == "cpu":
    nbytes = min(nbytes, 64 << 20)
  x = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 255)
  y = torch.empty_like(x)
  ms = time_torch(lambda: y.copy_(x))
  del x, y
  return 2 * nbytes / (ms * 1e-3) / 1e12


def peak_device_gib() -> float:
  """Peak bytes JAX has held on its first device, GiB (0 where the device does not say)."""
  import jax
  stats = jax.devices()[0].memory_stats() or {}
  return stats.get("peak_bytes_in_use", 0) / 2**30


def versions() -> dict:
  """Python / jax / jaxlib / torch / triton versions that are importable."""
  out = {"python": platform.python_version()}
  for name in ("jax", "jaxlib", "torch", "triton"):
    try:
      mod = __import__(name)
      out[name] = getattr(mod, "__version__", "?")
    except Exception:  # noqa: BLE001 - a missing optional package is reported as absent
      out[name] = None
  return out


def device_name() -> str:
  import jax
  d = jax.devices()[0]
  return f"{d.platform}: {getattr(d, 'device_kind', str(d))}"


def first_lines(e: BaseException, n: int = 3) -> str:
  """The exception's type and first ``n`` lines of its message, at most 400 characters."""
  text = f"{type(e).__name__}: {e}".strip().splitlines()
  return " | ".join(text[:n])[:400]


def now_utc() -> str:
  return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_line() -> str:
  return "python " + " ".join(sys.argv)


def announce_smoke(where: str = "cpu"):
  """The first line of every ``--smoke`` run: what its numbers are worth."""
  print(f"smoke run on {where}: tiny shapes; it checks that the benchmark runs, its timings "
        "mean nothing", flush=True)


def output_path(given, name: str):
  """Where a result file goes: ``given`` (the script's ``--json`` / ``--md``), else
  ``$OUT/<name>`` when ``$OUT`` is set, else None (results are printed only)."""
  if given:
    return given
  out = os.environ.get("OUT")
  return os.path.join(out, name) if out else None


def exit_after(main) -> None:
  """Run a benchmark's ``main`` and leave the process at once, its output flushed.

  A process that has both torch and jaxlib loaded can abort in their C++ teardown after
  ``main`` has returned ("terminate called without an active exception", exit status -6:
  seen on a CPU run of ``bench_facade.py --smoke``, rarely): the results are written by then,
  so the scripts that load both skip that teardown (``os._exit``). An exception still ends
  the process the usual way, with its traceback."""
  main()
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(0)
