"""Digests of the compiled programs of the side-by-side benchmark's steps, for the kvjax first on
``PYTHONPATH``: two source trees whose digests are equal compile those steps to the same
programs, so a change outside the kernels (dispatch, validation, metadata) that leaves them
equal cannot change their speed.

The steps are those ``benchmarks/bench_side_by_side.py`` times (``--impl`` as there): a decode
step chained 3 times (bf16 NHD 64 x 4096, fp8 HND 8 x 32768), a 4 x 4096 causal prefill and the
serving mix (one 4096-token prefill + 64 decodes at 4096). The compiled HLO text is normalized
(metadata and value names dropped, lines sorted; source locations inside kernels made
tree-independent, :func:`same_locations`) and hashed; ``--save PREFIX`` also writes each
normalized text to ``PREFIX_<step>.txt`` for a diff::

    PYTHONPATH=.ab/base python3 benchmarks/hlo_digest.py > base.json   # a tree from ab.py prepare
    python3 benchmarks/hlo_digest.py > head.json
    python benchmarks/hlo_digest.py --smoke                            # tiny shapes, any machine
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(_HERE) not in sys.path:
  sys.path.append(os.path.dirname(_HERE))

import jax  # noqa: E402

import kvjax  # noqa: E402
from benchmarks import bench_side_by_side as sbs  # noqa: E402
from benchmarks import common  # noqa: E402

#: (step, cache dtype, layout, query lengths, context lengths); decode steps are chained.
STEPS = (("decode", "bfloat16", "NHD", [1] * 64, [4095] * 64),
         ("decode", "fp8", "HND", [1] * 8, [32767] * 8),
         ("prefill", "bfloat16", "NHD", [4096] * 4, [0] * 4),
         ("mix", "bfloat16", "NHD", [4096] + [1] * 64, [0] + [4095] * 64))
SMOKE_STEPS = (("decode", "bfloat16", "NHD", [1] * 4, [63] * 4),
               ("mix", "int8_per_token_head", "HND", [32, 1], [0, 40]))


#: Lines of the source-location tables (section titles, numbered entries) some builds print.
_LOCATION_LINE = re.compile(r"^(FileNames|FunctionNames|FileLocations|StackFrames|\d+ .*)$")


def normalized(hlo: str) -> str:
  """Compiled HLO text without metadata, source-location tables and value names, its lines
  sorted."""
  hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
  hlo = re.sub(r"%[\w.\-]+", "%v", hlo)
  lines = (line.strip() for line in hlo.splitlines())
  return "\n".join(sorted(line for line in lines if line and not line.startswith("HloModule")
                          and not _LOCATION_LINE.match(line)))


def digest(step: str, cache_dtype: str, layout: str, q_lens, ctx_lens, impl: str, geo: dict):
  """(name, normalized compiled HLO) of one step."""
  spec = kvjax.KVCacheSpec(cache_dtype=cache_dtype, layout=layout, **geo)
  problem = sbs.paged_problem(spec, q_lens, ctx_lens)
  fn = sbs.kvjax_step(spec, impl, max(q_lens), None)   # compiled where native (auto: always)
  jitted = common.chained(lambda x, *r: fn(x, *r), 3) if step == "decode" else jax.jit(fn)
  name = f"{step}_{cache_dtype}_{layout}_{len(q_lens)}x{max(q + c for q, c in zip(q_lens, ctx_lens))}"
  return name, normalized(jitted.lower(*problem).compile().as_text())


def same_locations():
  """Make the source locations inside kernels tree-independent: the innermost frame only (a
  kernel's own lines), file paths from the package directory on (``kvjax/...``). Kernel IR
  (Triton's, Mosaic GPU's) carries its locations into the HLO text, so without this two
  checkouts' identical kernels hash apart."""
  jax.config.update("jax_include_full_tracebacks_in_locations", False)
  jax.config.update("jax_hlo_source_file_canonicalization_regex",
                    r"^.*/(?=(kvjax|pallas_kernels|benchmarks)/)")


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--impl", default="auto")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
  ap.add_argument("--save", default=None, help="write each normalized program to PREFIX_<step>.txt")
  args = ap.parse_args()
  same_locations()
  geo = dict(num_kv_heads=2, head_size=64, block_size=16) if args.smoke else dict(
      num_kv_heads=sbs.H, head_size=sbs.D, block_size=sbs.N)
  out = {"kvjax": os.path.dirname(os.path.abspath(kvjax.__file__)), "impl": args.impl,
         "steps": {}}
  for case in SMOKE_STEPS if args.smoke else STEPS:
    name, text = digest(*case, args.impl, geo)
    out["steps"][name] = dict(sha256=hashlib.sha256(text.encode()).hexdigest()[:16],
                              lines=text.count("\n") + 1, conditional="conditional(" in text)
    if args.save:
      with open(f"{args.save}_{name}.txt", "w") as f:
        f.write(text)
  print(json.dumps(out, indent=1))


if __name__ == "__main__":
  main()
