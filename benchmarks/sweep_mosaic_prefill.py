"""Sweep of the Mosaic GPU ragged kernel's tile geometry and staging on the H200 (prefill).

GPU:  python3 benchmarks/sweep_mosaic_prefill.py [--problems 4x4096,16x1024,1x16384]
          [--configs default,bk=64:stages=4,staging=swizzled] [--rounds 2] [--json FILE]
      ncu -k regex:kvjax_mgpu_ragged --clock-control none --section SpeedOfLight \
          python3 benchmarks/sweep_mosaic_prefill.py --configs default --once
Kernels: python3 benchmarks/sweep_mosaic_prefill.py --configs default --trace

Per problem of ``prefill_peers.PROBLEMS`` (bf16, Hq 32, H 8, D 128, block 16, causal, pages
shuffled, NHD): our kernel in each configuration, ``--rounds`` times over all of them in one
process (timings drift between rounds of one job; compare within a round), µs and TFLOP/s,
and in the first round the largest difference of each configuration's output from the
default's. A configuration is ``default`` or ``key=value`` pairs joined by ``:`` over the
default tile (``tiles.choose_geometry``): ``bk`` (keys a step), ``stages`` (K/V slots),
``bq`` (tokens a tile), ``wgs`` (consumer warpgroups), ``staging`` (``tiles.STAGINGS``),
the switches ``causal`` and ``pingpong`` (0 or 1; ``causal=0`` attends to every key of
the sequence, its TFLOP/s counted over all of them) and ``regs=CONSUMER/PRODUCER``
(registers a thread of each warpgroup, e.g. ``regs=240/24``).
A configuration that does not fit shared memory is reported as an error row. ``--once``
runs each configuration once per problem (no timing, no comparison), for a profiler to wrap.
``--trace`` prints, per problem and configuration, the device kernels of one call (tile
metadata in XLA, the kernel) from a profiler trace (``benchmarks/device_trace.py``) next to
the host clock of the tables. With ``--rounds 1`` it can be timed on several source trees by
``benchmarks/ab.py run`` (its rows are matched on problem and configuration).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DEFAULT_CONFIGS = ("default,bk=64:stages=4,bk=64:stages=5:staging=swizzled,bk=64:stages=3,"
                   "staging=swizzled,bq=16:wgs=1,regs=240/24")
_GEOMETRY_KEYS = {"bk": "block_kv", "stages": "stages", "bq": "bq", "wgs": "num_wgs"}
#: Switches of ``ragged_paged_attention_tiled`` (0 or 1).
_SWITCH_KEYS = {"causal": "causal", "pingpong": "ping_pong"}
_KEYS = sorted([*_GEOMETRY_KEYS, *_SWITCH_KEYS, "regs", "staging"])


def parse_config(text: str) -> dict:
  """``"bk=64:stages=4"`` -> ``{"block_kv": 64, "stages": 4}``; ``"default"`` -> ``{}``;
  ``staging=NAME`` is kept as a string, ``causal`` / ``pingpong`` become booleans,
  ``regs=240/24`` the pair ``(240, 24)``. Unknown keys, switch values other than 0 / 1 and
  register pairs that are not two integers raise ValueError naming them."""
  if text == "default":
    return {}
  out = {}
  for part in text.split(":"):
    key, sep, value = part.partition("=")
    if not sep or not value:
      raise ValueError(f"configuration {text!r}: {part!r} is not key=value")
    if key == "staging":
      out["staging"] = value
    elif key == "regs":
      pair = value.split("/")
      if len(pair) != 2 or not all(p.isdigit() for p in pair):
        raise ValueError(f"configuration {text!r}: regs must be CONSUMER/PRODUCER, got "
                         f"{value!r}")
      out["registers"] = (int(pair[0]), int(pair[1]))
    elif key in _GEOMETRY_KEYS:
      out[_GEOMETRY_KEYS[key]] = int(value)
    elif key in _SWITCH_KEYS:
      if value not in ("0", "1"):
        raise ValueError(f"configuration {text!r}: {key} must be 0 or 1, got {value!r}")
      out[_SWITCH_KEYS[key]] = value == "1"
    else:
      raise ValueError(f"configuration {text!r}: unknown key {key!r} (expected one of "
                       f"{_KEYS})")
  return out


def kernel_kwargs(config: dict, default_geometry) -> dict:
  """The ``ragged_paged_attention_tiled`` keywords of a parsed configuration: the tile
  geometry's fields as one ``geometry``, every other key as it is."""
  geo_fields = set(_GEOMETRY_KEYS.values())
  kw = {k: v for k, v in config.items() if k not in geo_fields}
  geo_changes = {k: v for k, v in config.items() if k in geo_fields}
  if geo_changes:
    kw["geometry"] = dataclasses.replace(default_geometry, **geo_changes)
  return kw


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--problems", default="4x4096,16x1024,1x16384")
  ap.add_argument("--configs", default=DEFAULT_CONFIGS)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--json", default=None)
  ap.add_argument("--once", action="store_true",
                  help="run each configuration once per problem, untimed (for ncu)")
  ap.add_argument("--trace", action="store_true",
                  help="print each call's device kernels from a profiler trace")
  args = ap.parse_args()
  configs = [("default", {})] + [(c, parse_config(c)) for c in args.configs.split(",")
                                 if c != "default"]     # the default first: the reference

  import jax
  import jax.numpy as jnp
  import numpy as np
  import kvjax
  from benchmarks import device_trace
  from benchmarks import prefill_peers as P
  from benchmarks.check_mosaic_gpu import ours_fn
  from benchmarks.common import now_utc, time_jax, versions
  from pallas_kernels.mosaic_gpu import tiles as TL

  rng = np.random.default_rng(1)
  spec = kvjax.KVCacheSpec(P.H, P.D, P.N, layout="NHD", dtype=jnp.bfloat16)
  scale = P.D ** -0.5
  wanted = args.problems.split(",")
  problems = [(name, ql, cl) for name, ql, cl in P.PROBLEMS if name in wanted]
  batches = {name: P.paged_batch(rng, spec, ql, cl) for name, ql, cl in problems}
  rows, fns, ref = [], {}, {}
  print(f"{now_utc()} {versions()}", flush=True)
  for rnd in range(1 if args.once else args.rounds):
    for name, ql, cl in problems:
      batch = batches[name]
      mql = max(ql)
      geo = TL.choose_geometry(P.HQ // P.H, P.D, P.N, mql)
      for label, config in configs:
        row = dict(round=rnd, problem=name, variant=label)   # "variant": ab.py's row key
        flops = P.attention_flops(ql, cl, causal=config.get("causal", True))
        try:
          if (name, label) not in fns:
            fns[name, label] = ours_fn(spec, scale, mql, **kernel_kwargs(config, geo))
          f = fns[name, label]
          if args.once:             # one untimed call, for a profiler
            jax.block_until_ready(f(*batch))
            row["ran"] = True
          else:
            if rnd == 0 and config.get("causal", True):   # non-causal: other numbers
              out = np.asarray(f(*batch), np.float32)
              ref.setdefault(name, out)
              row["max_diff_vs_default"] = float(np.max(np.abs(out - ref[name])))
            ms = time_jax(f, *batch, **P.TIMING)
            row.update(us=1e3 * ms, tflops=P.tflops(flops, ms))
            if args.trace:
              kernels, span = device_trace.kernel_breakdown(f, *batch)
              row.update(span_us=span, kernels=[dict(name=n[:90], us=us, launches=k)
                                                for n, us, k in kernels])
        except Exception as e:  # noqa: BLE001 - a configuration that fails is a row
          row["error"] = str(e).splitlines()[0][:200]
        print(json.dumps(row), flush=True)
        rows.append(row)
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(dict(command=" ".join(sys.argv), versions=versions(), rows=rows), fh, indent=1)


if __name__ == "__main__":
  main()
