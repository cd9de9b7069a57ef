"""The op and kernel test suites compiled on a GPU, in groups, each under its own time limit.

The same tests that run in interpret mode on a CPU run here with ``KVJAX_TEST_COMPILED=1``
(every implementation native to the platform runs compiled, the others skip). Each group is one
pytest process with ``-n WORKERS`` xdist workers and ``XLA_PYTHON_CLIENT_PREALLOCATE=false``
(otherwise every worker reserves most of the GPU's memory and the suites fail out of memory),
so that a slow group cannot eat the others' time. One line per group, also when its limit
stopped it (the tests finished by then are counted)::

    python3 tests/compiled_groups.py                         # every group
    python3 tests/compiled_groups.py --groups write,triton --limit-s 120 --log-dir $OUT

Mosaic GPU interpret-mode tests (minutes each on the host's CPU) are left out unless
``--with-mosaic-interpret``; the slow tier is included.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Group name -> test files, in the order they run by default.
GROUPS = {
    "write": ["tests/test_op_write.py", "tests/test_triton_write.py", "tests/test_quant.py",
              "tests/test_layered.py", "tests/test_edges.py", "tests/test_write_bounds.py"],
    "triton": ["tests/test_triton_decode.py", "tests/test_triton_ragged.py",
               "tests/test_fast_paths.py"],
    "attention": ["tests/test_op_attention.py", "tests/test_op_read.py"],
    "mosaic": ["tests/test_mosaic_gpu.py", "tests/test_mosaic_gpu_rotation.py",
               "tests/test_mosaic_gpu_direct.py",
               "tests/test_mosaic_gpu_decode.py",
               "tests/test_mosaic_gpu_write.py", "tests/test_mosaic_gpu_variants.py",
               "tests/test_registry.py"],
    "torch": ["tests/test_torch_backend.py", "tests/test_torch_bridge.py",
              "tests/test_torch_layered.py", "tests/test_vllm_adapter.py",
              "tests/test_facade_buckets.py", "tests/test_torch_launch.py",
              "tests/test_vllm_ops.py"],
    "transfer": ["tests/test_transfer_ipc.py", "tests/test_pages.py"],
}
_OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def environment() -> dict:
  env = dict(os.environ, KVJAX_TEST_COMPILED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
             PYTHONUNBUFFERED="1")
  env.setdefault("JAX_PLATFORMS", "cuda,cpu")
  return env


def command(files: list, workers: int, with_interpret: bool) -> list:
  marks = "slow or not slow" if with_interpret else "(slow or not slow) and not mosaic_interpret"
  cmd = [sys.executable, "-m", "pytest", "-v", "-rN", "-p", "no:cacheprovider", "-m", marks,
         *files]                      # -rN: no summary list, which would name failures twice
  return cmd + (["-n", str(workers)] if workers > 1 else [])


def count(output: str) -> dict:
  """Outcome -> number of tests, from pytest's ``-v`` lines (with or without xdist), so that
  a run stopped before its summary still counts what finished."""
  counts = dict.fromkeys(_OUTCOMES, 0)
  for m in re.finditer(r"(?:^|\s)(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?=[\s(]|$)", output,
                       re.MULTILINE):
    word = m.group(1).lower()
    counts[{"xfail": "xfailed", "xpass": "xpassed"}.get(word, word)] += 1
  return counts


def summary(name: str, counts: dict, seconds: float, stopped: bool, limit_s: int) -> str:
  parts = ", ".join(f"{n} {k}" for k, n in counts.items() if n or k in ("passed", "failed"))
  tail = f"stopped at its {limit_s} s limit" if stopped else f"{seconds:.0f} s"
  return f"{name}: {parts} ({tail})"


def run_group(name: str, files: list, limit_s: int, workers: int, with_interpret: bool,
              log_dir: str | None) -> tuple[dict, bool]:
  t0 = time.time()
  try:
    done = subprocess.run(command(files, workers, with_interpret), cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=limit_s)
    output, stopped = done.stdout + done.stderr, False
  except subprocess.TimeoutExpired as e:
    output = "".join(x.decode() if isinstance(x, bytes) else (x or "")
                     for x in (e.stdout, e.stderr))
    stopped = True
  if log_dir:
    with open(os.path.join(log_dir, f"compiled_{name}.log"), "w") as f:
      f.write(output)
  counts = count(output)
  print(summary(name, counts, time.time() - t0, stopped, limit_s), flush=True)
  return counts, stopped


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--groups", default=",".join(GROUPS), help=f"of {', '.join(GROUPS)}")
  ap.add_argument("--limit-s", type=int, default=150, help="time limit of each group")
  ap.add_argument("--workers", type=int, default=4)
  ap.add_argument("--with-mosaic-interpret", action="store_true")
  ap.add_argument("--log-dir", default=None, help="one pytest log per group here")
  args = ap.parse_args()
  names = [g for g in args.groups.split(",") if g]
  unknown = [g for g in names if g not in GROUPS]
  if unknown:
    ap.error(f"--groups: {unknown} are not among {list(GROUPS)}")
  if args.log_dir:
    os.makedirs(args.log_dir, exist_ok=True)
  failed = 0
  for name in names:
    counts, _ = run_group(name, GROUPS[name], args.limit_s, args.workers,
                          args.with_mosaic_interpret, args.log_dir)
    failed += counts["failed"] + counts["error"]
  sys.exit(1 if failed else 0)


if __name__ == "__main__":
  main()
