"""Disaggregated prefill/decode on simulated CPU devices: a request's KV blocks move from a
prefill group (TP=2) to a decode group (TP=4) with a different TP size and other block ids.

  python examples/disaggregated_transfer.py

Prefill writes the prompt's K/V into a head-sharded cache (kvjax.sharding) on devices 0-1;
the request's pages move per layer to per-rank decode caches on devices 2-5 by read plans
(kvjax.transfer; the rules are docs/layout.md §7); decode attention over the sharded decode cache is checked
against the reference over one unsharded cache written directly. Runs in seconds on CPU.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import kvjax  # noqa: E402
import kvjax.transfer  # noqa: E402
from kvjax import sharding as KS  # noqa: E402

H, HQ, D, N = 4, 16, 64, 16            # KV heads, query heads, head size, block size
P_TP, D_TP, LAYERS = 2, 4, 2
PROMPT = 45                            # tokens: 3 blocks, the last partial
LAYOUT, CACHE_DTYPE = "HND", "fp8_per_token_head"


def main():
  devs = jax.devices()
  rng = np.random.default_rng(0)
  spec = kvjax.KVCacheSpec(H, D, N, cache_dtype=CACHE_DTYPE, layout=LAYOUT)   # global spec
  prefill_mesh = Mesh(np.asarray(devs[:P_TP]), ("tp",))
  decode_mesh = Mesh(np.asarray(devs[P_TP:P_TP + D_TP]), ("tp",))
  decode_rank_spec = KS.shard_spec(spec, D_TP)
  src_blocks, dst_blocks = np.array([5, 0, 3]), np.array([2, 7, 4])
  pos = np.arange(PROMPT)
  src_slots = jnp.asarray(src_blocks[pos // N] * N + pos % N, jnp.int32)

  k = jnp.asarray(rng.standard_normal((LAYERS, PROMPT, H, D)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((LAYERS, PROMPT, H, D)), jnp.bfloat16)
  q = jnp.asarray(rng.standard_normal((1, HQ, D)), jnp.bfloat16)   # the next decode token
  meta = dict(query_start_loc=jnp.array([0, 1]), seq_lens=jnp.array([PROMPT]),
              block_table=jnp.asarray([dst_blocks]), scale=D ** -0.5)

  print(f"prefill TP={P_TP} on {devs[:P_TP]}, decode TP={D_TP} on {devs[P_TP:P_TP + D_TP]}")
  print(f"cache {CACHE_DTYPE} {LAYOUT}, H={H} KV heads (decode rank holds {H // D_TP}), "
        f"page {decode_rank_spec.page_bytes} B local / "
        f"{KS.shard_spec(spec, P_TP).page_bytes} B remote")
  for r in range(D_TP):
    reads = kvjax.transfer.plan_reads(decode_rank_spec, tp_rank=r, tp_size=D_TP,
                                      remote_tp_size=P_TP, total_num_kv_heads=H)
    print(f"  decode rank {r}: {reads}")
  descs = kvjax.transfer.descriptors(decode_rank_spec, num_blocks=8, num_regions=LAYERS,
                                     block_ids=dst_blocks, remote_block_ids=src_blocks,
                                     tp_rank=0, tp_size=D_TP, remote_tp_size=P_TP,
                                     total_num_kv_heads=H)
  print(f"  descriptors of decode rank 0 over {LAYERS} layers: {len(descs)}")

  worst, moved, t_move = 0.0, 0, 0.0
  for layer in range(LAYERS):
    # Prefill: write the prompt into the head-sharded prefill cache.
    pcache = spec.allocate(8, sharding=KS.cache_sharding(prefill_mesh, spec))
    pcache = KS.sharded_write_kv(pcache, k[layer], v[layer], src_slots, spec, prefill_mesh)
    # Transfer: per-rank prefill shards -> per-rank decode caches, other block ids.
    dcaches = [jax.device_put(decode_rank_spec.allocate(8), d)
               for d in devs[P_TP:P_TP + D_TP]]
    t0 = time.perf_counter()
    dcaches = kvjax.transfer.transfer_blocks(KS.rank_caches(pcache, spec, prefill_mesh), dcaches,
                                             decode_rank_spec, src_blocks, dst_blocks,
                                             total_num_kv_heads=H)
    jax.block_until_ready(dcaches)
    t_move += time.perf_counter() - t0
    moved += D_TP * len(dst_blocks) * decode_rank_spec.page_bytes
    # Decode: attention over the sharded decode cache vs one unsharded cache written directly.
    dcache = KS.from_rank_caches(dcaches, spec, decode_mesh)
    out = KS.sharded_unified_attention(q, dcache, spec, decode_mesh, **meta)
    dst_slots = jnp.asarray(dst_blocks[pos // N] * N + pos % N, jnp.int32)
    direct = kvjax.write_kv(spec.allocate(8), k[layer], v[layer], dst_slots, spec)
    ref = kvjax.unified_attention(q, direct, spec, impl="reference", **meta)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
    same_bytes = np.array_equal(np.asarray(dcache).view(np.uint8), np.asarray(direct).view(np.uint8))
    print(f"layer {layer}: decode cache byte-exact vs direct write: {same_bytes}; "
          f"attention max |err| = {err:.3g}")
    worst = max(worst, err)
    assert same_bytes and err == 0.0
  print(f"moved {moved} bytes ({LAYERS} layers x {D_TP} ranks x {len(dst_blocks)} pages) in "
        f"{t_move * 1e3:.1f} ms (CPU, compile included); worst attention error {worst}")


if __name__ == "__main__":
  main()
