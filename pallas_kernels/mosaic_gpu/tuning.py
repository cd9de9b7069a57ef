"""The Mosaic GPU kernels' tuning table: every measured default and ``auto`` rule constant.

Each names the row of ``benchmarks/RESULTS.md`` ("Tuned defaults") that justifies it, by its
id in backticks. The geometry rules that follow from shared-memory budgets (how many K/V
slots fit, the decode split count) live with the geometry (:mod:`.tiles`,
:mod:`.decode_geometry`); what they assume of the GPU comes from here.
"""
from __future__ import annotations

from pallas_kernels.common import gpu_device_kind, gpu_sm_count

#: The (``cache_dtype``, layout) pairs whose decode batches ``auto`` gives the decode kernel;
#: the Triton decode kernel runs the others (`mgpu-decode-rule`, H100: the decode kernel is
#: faster at every measured shape only on the per token-head formats int8 and fp8 in NHD; on
#: int4 and nvfp4 it takes 1.2-1.6x the Triton kernel's time).
AUTO_DECODE = frozenset({("fp8_per_token_head", "NHD"), ("int8_per_token_head", "NHD")})

#: :data:`AUTO_DECODE` of the GPUs whose measurements differ, by a part of their
#: ``device_kind`` (`mgpu-decode-rule`, H200: with its faster memory the Triton kernel is
#: ahead on int8 per token-head NHD too; the decode kernel takes 1.01-1.19x its time).
AUTO_DECODE_BY_GPU = {"H200": frozenset({("fp8_per_token_head", "NHD")})}


def auto_decode(device_kind: str | None = None) -> frozenset:
  """The :data:`AUTO_DECODE` pairs of a GPU (``device_kind``; None: this process's GPU's)."""
  kind = gpu_device_kind() if device_kind is None else device_kind
  return next((pairs for part, pairs in AUTO_DECODE_BY_GPU.items() if part in kind),
              AUTO_DECODE)

#: Key steps of 64 per softmax update of the decode kernel (1 or 2; formats whose view rows
#: hold two tokens always take 2): `mgpu-decode-rounds`.
DECODE_ROUND_STEPS = 1

#: Blocks of one warpgroup the decode kernel's shared memory is sized for on one SM, and
#: its split rule fills (`mgpu-decode-blocks`: two, with more K/V slots each, beat three on
#: every format but nvfp4).
DECODE_BLOCKS_PER_SM = 2

#: Formats (``cache_dtype``) whose decode blocks are sized and counted otherwise
#: (`mgpu-decode-blocks`: nvfp4 with 3 blocks an SM, fewer slots each, took 0.85-0.87x the
#: time of 2).
DECODE_BLOCKS_PER_SM_BY_FORMAT = {"nvfp4": 3}


def decode_blocks_per_sm(cache_dtype: str) -> int:
  """Blocks of the decode kernel an SM is sized for, for caches of ``cache_dtype``."""
  return DECODE_BLOCKS_PER_SM_BY_FORMAT.get(cache_dtype, DECODE_BLOCKS_PER_SM)


#: ``auto`` takes the ragged kernel for batches whose static ``max_query_len`` is at least
#: this (`mgpu-ragged-rule`: faster than the Triton kernels from query chunks of 128 tokens
#: on, slower on pure decode and on 16-token chunks).
AUTO_MIN_QUERY_LEN = 128

#: Work items (KV head x query tile) go to persistent blocks, one per SM, each walking its
#: items in turn so that its producer copies the next item's first K/V steps while its
#: consumers finish the current one (`mgpu-persistent`).
PERSISTENT = True

#: How the ragged kernel issues ``acc += P V`` compiled (`mgpu-p-regs`): P as the register A
#: operand of wgmma (``tiles.PV_VARIANTS``).
DEFAULT_PV = "p_regs"

#: Swizzle (bytes) of the shared-memory slots fp8 K/V tiles land in: the 32-byte one, whose
#: tiles the 4-byte upcast loads read (`mgpu-fp8-upcast`).
FP8_LANDING_SWIZZLE = 32


#: Formats (``cache_dtype``) whose ragged calls read the pages as stored, the producer
#: converting each step (:mod:`.ragged_landing`); the others read a plain copy of the
#: batch's pages (`mgpu-ragged-direct`).
RAGGED_DIRECT = frozenset()


def num_programs(interpret: bool) -> int:
  """CUDA blocks of a ragged call: one per SM with :data:`PERSISTENT` (one block fills an
  SM's shared memory), else 0 (one block per work item). Interpret mode, and a host without
  a GPU (lowering for CUDA on a CPU): 0."""
  if interpret or not PERSISTENT:
    return 0
  return gpu_sm_count(0)


def num_sms() -> int:
  """SMs the decode split rule fills: this process's GPU's, 132 (H100 SXM, H200) without
  one."""
  return gpu_sm_count(132)
