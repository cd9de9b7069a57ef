"""Where a jitted program's device time goes: its kernels, one by one, from a profiler trace.

:func:`kernel_breakdown` runs a jitted function a few times under ``jax.profiler`` (CUPTI on
a GPU), reads the Perfetto trace it writes and sums, per kernel name, the device time spent
per call; the span from a call's first kernel start to its last kernel end, less the kernels'
own time, is the time between kernels (launch gaps and idle). Host-clock timings
(:func:`benchmarks.common.time_jax`) say how long a step takes; this says which kernels make
it up.

    >>> import jax, jax.numpy as jnp
    >>> rows, span_us = kernel_breakdown(jax.jit(lambda x: x * 2), jnp.ones(8), calls=2)
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import tempfile


def _device_events(trace: dict) -> list:
  """Complete events on the device's stream lines (GPU) of a Perfetto trace; none on CPU."""
  events = trace["traceEvents"]
  procs, threads = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      procs[e["pid"]] = e["args"]["name"]
    if e.get("ph") == "M" and e.get("name") == "thread_name":
      threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
  device_lines = {k: v for k, v in threads.items() if "/device:" in procs.get(k[0], "")}
  on_device = [e for e in events if e.get("ph") == "X" and "dur" in e
               and device_lines.get((e["pid"], e.get("tid")), "").startswith("Stream")]
  if device_lines and not on_device:
    raise ValueError(f"no 'Stream' line among the device's trace lines "
                     f"{sorted(set(device_lines.values()))}")
  return on_device


def kernel_breakdown(fn, *args, calls: int = 5):
  """Per-kernel device time of ``fn(*args)`` (jitted; warmed up here).

  Returns:
    (rows, span_us): rows ``[(kernel name, µs per call, launches per call)]``, longest
    first; span_us the device time from the first kernel start to the last kernel end,
    per call (``calls`` back-to-back calls, so it includes the gaps between calls).
    Empty rows when the backend records no device streams (CPU).
  """
  import jax
  jax.block_until_ready(fn(*args))
  log_dir = tempfile.mkdtemp(prefix="kvjax_trace_")
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    out = None
    for _ in range(calls):
      out = fn(*args)
    jax.block_until_ready(out)
  (path,) = glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True)
  with gzip.open(path) as f:
    return summarize(json.load(f), calls)


def summarize(trace: dict, calls: int):
  """:func:`kernel_breakdown`'s result from a Perfetto trace (``traceEvents``) of ``calls``
  calls."""
  events = _device_events(trace)
  total, count = collections.defaultdict(float), collections.Counter()
  for e in events:
    total[e["name"]] += e["dur"]
    count[e["name"]] += 1
  rows = sorted(((name, us / calls, count[name] / calls) for name, us in total.items()),
                key=lambda r: -r[1])
  span = 0.0
  if events:
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / calls
  return rows, span
