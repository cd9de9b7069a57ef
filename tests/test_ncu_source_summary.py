"""benchmarks/tools/ncu_source_summary.py on a small hand-made export in ncu's source-page CSV form:
the header line before the table, predicates stripped from opcodes, regions by execution
count, samples summed per reason and per opcode."""
import gzip

from benchmarks.tools import ncu_source_summary as N

_CSV = '''"Kernel Name","k",
"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed","stall_wait","stall_barrier","stall_wait (Not Issued)"
"0x10","      LDC R1, c[0x0][0x28]","2","4","2","0","0"
"0x20","      MUFU.EX2 R2, R2","10","64","7","0","1"
"0x30","@!P1  BRA 0x40","5","64","0","5","0"
"0x40","      MUFU.EX2 R3, R3","6","64","6","0","0"
"0x50","      EXIT","-","4","0","0","0"
'''


def test_summary_of_a_small_export(tmp_path):
  path = tmp_path / "src.csv.gz"
  with gzip.open(path, "wt") as fh:
    fh.write(_CSV)
  rows = N.read_source_csv(str(path))
  assert [r["Source"].split()[0] for r in rows] == ["LDC", "MUFU.EX2", "@!P1", "MUFU.EX2",
                                                   "EXIT"]
  assert rows[4][N.SAMPLES] == 0.0                      # "-" reads as 0
  assert N.stall_reasons(rows) == ["stall_wait", "stall_barrier"]
  assert N.by_reason(rows) == {"wait": 15.0, "barrier": 5.0}
  hot, cold = N.regions(rows)
  assert (hot["executed"], hot["samples"], hot["instructions"], hot["first"], hot["last"]) == (
      64, 21.0, 3, 1, 3)
  assert (cold["executed"], cold["samples"]) == (4, 2.0)
  ops = N.by_opcode(rows, 64)
  assert [(op, n, s) for op, n, s, _ in ops] == [("MUFU.EX2", 2, 16.0), ("BRA", 1, 5.0)]
  assert ops[0][3] == {"wait": 13.0, "barrier": 0.0}
