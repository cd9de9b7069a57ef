"""Transfer plans (docs/layout.md §7): worked example, TP ratios, offsets, replication, descriptors,
refusals, and every plan checked against an independent per-head byte oracle."""
import itertools

import numpy as np
import pytest

import kvjax
import kvjax.transfer
from kvjax.transfer import Read

SIZES = (1, 2, 4, 8)


def spec_for(total_heads, tp, head_size=128, cache_dtype="auto", layout="HND"):
  h = kvjax.transfer.heads_per_rank(total_heads, tp)
  return kvjax.KVCacheSpec(h, head_size, 16, cache_dtype=cache_dtype, layout=layout)


def test_worked_example():
  """HND bf16, D=128, N=16, H=8, P=2 -> D=4: rank r reads remote r//2 at (r%2)*16384."""
  local = spec_for(8, 4)
  assert local.page_bytes == 16384
  assert kvjax.transfer.remote_spec(local, 2, 8).page_bytes == 32768
  for r in range(4):
    reads = kvjax.transfer.plan_reads(local, tp_rank=r, tp_size=4, remote_tp_size=2,
                                      total_num_kv_heads=8)
    assert reads == [Read(r // 2, (r % 2) * 16384, 16384, 0)]


def test_tp_ratio():
  assert kvjax.transfer.tp_ratio(4, 2) == 2
  assert kvjax.transfer.tp_ratio(2, 8) == -4
  assert kvjax.transfer.tp_ratio(4, 4) == 1
  for bad in [(3, 2), (2, 3), (0, 2), (2, -1)]:
    with pytest.raises(ValueError):
      kvjax.transfer.tp_ratio(*bad)


def test_probe_layout():
  probe = kvjax.transfer.probe_layout()
  assert probe.shape == (1, 1, 16, 2) and probe.blocks_first and probe.ndim == 4
  assert kvjax.transfer.probe_layout(is_mla=True).shape == (1, 16, 1)
  with pytest.raises(ValueError, match="5-D|4-D"):  # legacy kv-first (2, B, N, H, D)
    kvjax.transfer.probe_layout(lambda b, n, h, d: (2, b, n, h, d))
  with pytest.raises(ValueError, match="blocks-first"):  # K and V not packed per page
    kvjax.transfer.probe_layout(lambda b, n, h, d: (2, b, n, h * d))


def test_replication_and_source_ranks():
  assert not kvjax.transfer.is_kv_replicated(8, 8)
  assert kvjax.transfer.is_kv_replicated(8, 4)
  assert kvjax.transfer.is_kv_replicated(1, 4, is_mla=True)
  # H=2, P=8: ranks 0-3 hold head 0, ranks 4-7 head 1 -> GQA de-duplication.
  assert kvjax.transfer.source_ranks(0, 1, 8, 2) == [0, 4]
  assert kvjax.transfer.source_ranks(1, 2, 8, 2) == [4]
  assert kvjax.transfer.source_ranks(1, 2, 8, 16) == [4, 5, 6, 7]
  assert kvjax.transfer.source_ranks(5, 8, 2, 4) == [1]
  assert kvjax.transfer.source_ranks(3, 4, 8, 2, is_mla=True) == [6]


def test_rank_offset_factor():
  f = kvjax.transfer.rank_offset_factor
  assert [f(r, 4, 2, 8) for r in range(4)] == [0, 1, 0, 1]       # r % (D/P)
  assert [f(r, 8, 2, 4) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # D > H
  assert [f(r, 8, 4, 2) for r in range(8)] == [0] * 8           # both replicated
  assert f(1, 2, 4, 8) == 0 and f(3, 4, 1, 4, is_mla=True) == 0


# -- independent oracle: pages built per head, plan applied with numpy --------------------
def rank_page(parts, heads, spec):
  """One rank's page bytes from per-head parts (the oracle's own layout knowledge)."""
  if spec.cache_dtype == "nvfp4":
    return np.concatenate([parts[side][h] for side in ("kd", "ks", "vd", "vs") for h in heads])
  return np.concatenate([parts["row"][h] for h in heads])


def make_parts(rng, total_heads, spec):
  n = spec.block_size
  if spec.cache_dtype == "nvfp4":
    d2, s = spec.head_size // 2, spec.num_scales_per_row
    sizes = {"kd": n * d2, "ks": n * s, "vd": n * d2, "vs": n * s}
  else:
    sizes = {"row": n * spec.content_dim * spec.itemsize}
  return {k: rng.integers(0, 256, (total_heads, m), dtype=np.uint8) for k, m in sizes.items()}


def apply_reads(reads, remote_pages, local_bytes):
  out = np.full(local_bytes, -1, np.int32)
  for r in reads:
    assert (out[r.local_offset:r.local_offset + r.length] == -1).all(), "overlapping reads"
    out[r.local_offset:r.local_offset + r.length] = remote_pages[r.remote_rank][
        r.remote_offset:r.remote_offset + r.length]
  assert (out >= 0).all(), "reads leave bytes of the local page unwritten"
  return out.astype(np.uint8)


@pytest.mark.parametrize("cache_dtype,head_size", [("auto", 16), ("fp8_per_token_head", 16),
                                                   ("int4_per_token_head", 16), ("nvfp4", 64)])
def test_every_plan_matches_head_oracle(rng, cache_dtype, head_size):
  checked = 0
  for total, p, d in itertools.product((1, 2, 4, 8), SIZES, SIZES):
    local = spec_for(total, d, head_size, cache_dtype)
    remote = spec_for(total, p, head_size, cache_dtype)
    parts = make_parts(rng, total, local)
    remote_pages = [rank_page(parts, kvjax.transfer.local_heads(s, p, total), remote)
                    for s in range(p)]
    assert all(x.size == remote.page_bytes for x in remote_pages)
    for r in range(d):
      reads = kvjax.transfer.plan_reads(local, tp_rank=r, tp_size=d, remote_tp_size=p,
                                        total_num_kv_heads=total)
      want = rank_page(parts, kvjax.transfer.local_heads(r, d, total), local)
      np.testing.assert_array_equal(apply_reads(reads, remote_pages, local.page_bytes), want,
                                    err_msg=f"H={total} P={p} D={d} rank {r}")
      if cache_dtype == "nvfp4":   # data and scale run of each side, per source rank
        assert len(reads) == 4 * len({x.remote_rank for x in reads})
      checked += 1
  assert checked == sum(d for _ in (1, 2, 4, 8) for _ in SIZES for d in SIZES)


def test_nvfp4_slice_takes_k_and_v_heads():
  """D=2 from P=1, H=2: rank 1 needs K head 1 AND V head 1, not slots 2..3 of 2H."""
  local = spec_for(2, 2, 64, "nvfp4")          # 1 head: page = 2 * 16 * 36 = 1152 bytes
  reads = kvjax.transfer.plan_reads(local, tp_rank=1, tp_size=2, remote_tp_size=1,
                                    total_num_kv_heads=2)
  # Remote page (2 heads, 2304 bytes): K data 0..1023, K scales 1024..1151, V side at 1152.
  assert reads == [Read(0, 512, 512, 0), Read(0, 1024 + 64, 64, 512),
                   Read(0, 1152 + 512, 512, 576), Read(0, 1152 + 1024 + 64, 64, 1088)]


def test_mla_reads_whole_page():
  mla = kvjax.MLACacheSpec(576, 16)
  for r in range(4):
    reads = kvjax.transfer.plan_reads(mla, tp_rank=r, tp_size=4, remote_tp_size=8,
                                      total_num_kv_heads=1)
    assert reads == [Read(2 * r, 0, 16 * 576 * 2, 0)]
  assert kvjax.transfer.plan_reads(mla, tp_rank=3, tp_size=4, remote_tp_size=2,
                                   total_num_kv_heads=1) == [Read(1, 0, 18432, 0)]


def test_nhd_heterogeneous_refused_homogeneous_allowed():
  with pytest.raises(ValueError, match="NHD"):
    kvjax.transfer.plan_reads(spec_for(8, 4, layout="NHD"), tp_rank=0, tp_size=4,
                              remote_tp_size=2, total_num_kv_heads=8)
  same = spec_for(8, 2, layout="NHD")
  assert kvjax.transfer.plan_reads(same, tp_rank=1, tp_size=2, remote_tp_size=2,
                                   total_num_kv_heads=8) == [Read(1, 0, same.page_bytes, 0)]
  both_replicated = spec_for(2, 8, layout="NHD")  # 1 head on both sides
  assert kvjax.transfer.plan_reads(both_replicated, tp_rank=5, tp_size=8, remote_tp_size=4,
                                   total_num_kv_heads=2) == [
                                       Read(2, 0, both_replicated.page_bytes, 0)]


@pytest.mark.parametrize("kwargs,match", [
    (dict(tp_rank=0, tp_size=4, remote_tp_size=3, total_num_kv_heads=12), "multiple"),
    (dict(tp_rank=0, tp_size=4, remote_tp_size=2, total_num_kv_heads=6), "does not split"),
    (dict(tp_rank=4, tp_size=4, remote_tp_size=2, total_num_kv_heads=8), "tp_rank"),
    (dict(tp_rank=0, tp_size=2, remote_tp_size=4, total_num_kv_heads=8), "local head count"),
    (dict(tp_rank=0, tp_size=4, remote_tp_size=2, total_num_kv_heads=0), "positive"),
])
def test_refusals(kwargs, match):
  with pytest.raises(ValueError, match=match):
    kvjax.transfer.plan_reads(spec_for(8, 4), **kwargs)


def test_descriptors():
  local = spec_for(8, 4)                 # 16384-byte pages, remote 32768
  reads = kvjax.transfer.descriptors(local, num_blocks=10, num_regions=3, block_ids=[7, 2],
                                     remote_block_ids=[4, 9], remote_num_blocks=12, tp_rank=3,
                                     tp_size=4, remote_tp_size=2, total_num_kv_heads=8)
  assert len(reads) == 3 * 2 * 1
  assert all(r.length == 16384 and r.remote_rank == 1 for r in reads)
  assert [r.local_desc_id for r in reads] == [7, 2, 17, 12, 27, 22]
  assert [r.remote_desc_id for r in reads] == [4, 9, 16, 21, 28, 33]
  assert reads[0].remote_offset == 4 * 32768 + 16384 and reads[0].local_offset == 7 * 16384
  nv = spec_for(4, 2, 64, "nvfp4")
  nv_reads = kvjax.transfer.descriptors(nv, num_blocks=5, num_regions=2, block_ids=[0, 1, 2],
                                        remote_block_ids=[3, 4, 0], tp_rank=0, tp_size=2,
                                        remote_tp_size=4, total_num_kv_heads=4)
  assert len(nv_reads) == 2 * 3 * 8     # 2 source ranks x 4 runs per page
  per_page = sum(r.length for r in nv_reads) / (2 * 3)
  assert per_page == nv.page_bytes
  region = kvjax.transfer.region_descriptors(local.page_bytes, 10, 3)
  assert len(region) == 30 and region[13].desc_id == 13 and region[13].region == 1
  assert region[13].block == 3 and region[13].offset == 3 * 16384 and region[13].length == 16384
  with pytest.raises(ValueError, match="same length"):
    kvjax.transfer.descriptors(local, num_blocks=10, num_regions=1, block_ids=[1, 2],
                               remote_block_ids=[1], tp_rank=0, tp_size=4, remote_tp_size=2,
                               total_num_kv_heads=8)
  with pytest.raises(ValueError, match=r"\[0, 10\)"):
    kvjax.transfer.descriptors(local, num_blocks=10, num_regions=1, block_ids=[10],
                               remote_block_ids=[1], tp_rank=0, tp_size=4, remote_tp_size=2,
                               total_num_kv_heads=8)


def test_compact_reads_send_only_the_local_page():
  from kvjax.transfer.execute import compact_reads
  local = spec_for(4, 2, 64, "nvfp4")            # 2 heads a rank, from P=4 (1 head each)
  reads = kvjax.transfer.plan_reads(local, tp_rank=1, tp_size=2, remote_tp_size=4,
                                    total_num_kv_heads=4)
  compact, sends = compact_reads(reads)
  assert sorted(sends) == [2, 3]
  assert sum(r.length for runs in sends.values() for r in runs) == local.page_bytes
  for s, runs in sends.items():            # each source sends its runs back to back
    mine = [c for c in compact if c.remote_rank == s]
    assert [c.remote_offset for c in mine] == list(np.cumsum([0] + [r.length for r in runs])[:-1])
  assert [c.local_offset for c in compact] == [r.local_offset for r in reads]
