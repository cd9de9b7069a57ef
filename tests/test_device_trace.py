"""benchmarks/device_trace.py: per-kernel device time from a hand-made Perfetto trace in the form
JAX's profiler writes for a GPU (kernels on the device's stream lines, the same kernels again on
derived lines that must not count twice, host events ignored), and a real trace on CPU."""
import jax
import jax.numpy as jnp
import pytest

from benchmarks import device_trace as DT


def _meta(pid, name, tid=None):
  e = {"ph": "M", "pid": pid, "name": "thread_name" if tid else "process_name",
       "args": {"name": name}}
  if tid:
    e["tid"] = tid
  return e


def _kernel(pid, tid, ts, dur, name):
  return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name}


def _trace():
  events = [_meta(1, "/host:CPU"), _meta(1, "python", tid=10),
            _meta(7, "/device:GPU:0"), _meta(7, "Stream #13(Compute)", tid=1),
            _meta(7, "XLA Ops", tid=2)]
  for call in range(2):                   # two calls: decode 100 us, merge 4 us, 1 us gap each
    t0 = 1000.0 * call
    events += [_kernel(7, 1, t0, 100.0, "decode"), _kernel(7, 1, t0 + 101.0, 4.0, "merge"),
               _kernel(7, 2, t0, 105.0, "fusion.1"),               # a derived line: not counted
               _kernel(1, 10, t0, 900.0, "PjitFunction(step)")]    # host: not counted
  return {"traceEvents": events}


def test_kernels_per_call_from_the_stream_lines_only():
  rows, span = DT.summarize(_trace(), calls=2)
  assert rows == [("decode", 100.0, 1.0), ("merge", 4.0, 1.0)]
  assert span == (1105.0 - 0.0) / 2          # first start to last end, per call


def test_a_device_without_stream_lines_is_an_error():
  trace = _trace()
  trace["traceEvents"] = [e for e in trace["traceEvents"]
                          if not (e.get("args", {}).get("name", "").startswith("Stream"))]
  with pytest.raises(ValueError, match="no 'Stream' line"):
    DT.summarize(trace, calls=2)


def test_a_cpu_trace_has_no_device_kernels():
  rows, span = DT.kernel_breakdown(jax.jit(lambda x: x * 2), jnp.ones(8), calls=2)
  assert (rows, span) == ([], 0.0)
