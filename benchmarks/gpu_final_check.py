"""Short end-of-session check of the final kernels on the GPU, in priority order.

Re-measures the decode defaults at 64 x 4096 (bf16, fp8), re-checks the write kernel's bytes
against the jitted reference on the GPU and the CPU, and the ragged kernel's default tile
against the reference. Prints one line per result; `python benchmarks/gpu_final_check.py`.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np  # noqa: E402

from benchmarks import bench_decode, bench_prefill, bench_write, common  # noqa: E402

t0 = time.time()
print("versions", common.versions(), common.device_name(), flush=True)
for cd, itemsize in (("bfloat16", 2), ("fp8", 1)):
  ms = bench_decode.time_ours(64, 4096, cd, "NHD", None)
  tb = bench_decode.kv_bytes(64, 4096, itemsize) / (ms * 1e-3) / 1e12
  print(f"decode 64x4096 {cd} NHD default config: {ms * 1e3:.1f} us, {tb:.2f} TB/s, "
        f"{64 / (ms * 1e-3):.0f} tokens/s  [{time.time() - t0:.0f}s]", flush=True)
rng = np.random.default_rng(1)
for case in (("int8_per_token_head", "NHD", 8, 128, 16), ("fp8_per_token_head", "HND", 8, 128, 16),
             ("nvfp4", "HND", 8, 128, 16), ("fp8", "NHD", 8, 128, 16)):
  print(f"write {case}: {bench_write.check_case(rng, case, False, True)}  "
        f"[{time.time() - t0:.0f}s]", flush=True)
bench_prefill.checks(False)
print(f"done [{time.time() - t0:.0f}s]", flush=True)
