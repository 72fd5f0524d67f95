"""benchmarks/hlo_liveness.py: the live buffers of a scheduled HLO entry computation, by hand."""

from __future__ import annotations

from benchmarks.hlo_liveness import array_bytes, grouped, peak

HLO = """HloModule m, is_scheduled=true

%fused (p0: f32[4,8]) -> (f32[4,8], bf16[4,8]) {
  %p0 = f32[4,8]{1,0} parameter(0)
}

ENTRY %main (a: f32[4,8], b: f32[8,16]) -> (f32[4,16], f32[4,8]) {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,16]{1,0} parameter(1)
  %f = (f32[4,8]{1,0}, bf16[4,8]{1,0}) fusion(f32[4,8]{1,0} %a), kind=kLoop, calls=%fused, metadata={op_name="jit(f)/tanh"}
  %g0 = f32[4,8]{1,0} get-tuple-element((f32[4,8]{1,0}, bf16[4,8]{1,0}) %f), index=0
  %g1 = bf16[4,8]{1,0} get-tuple-element((f32[4,8]{1,0}, bf16[4,8]{1,0}) %f), index=1
  %mm = (f32[4,16]{1,0}, s8[1024]{0}) custom-call(f32[4,8]{1,0} %g0, f32[8,16]{1,0} %b), custom_call_target="gemm", metadata={op_name="jit(f)/dot_general"}
  %r = f32[4,16]{1,0} get-tuple-element((f32[4,16]{1,0}, s8[1024]{0}) %mm), index=0
  %c = f32[4,8]{1,0} convert(bf16[4,8]{1,0} %g1), metadata={op_name="jit(f)/convert_element_type"}
  %x = f32[4,16]{1,0} bitcast(f32[4,16]{1,0} %r)
  ROOT %t = (f32[4,16]{1,0}, f32[4,8]{1,0}) tuple(f32[4,16]{1,0} %x, f32[4,8]{1,0} %c)
}
"""


def test_array_bytes():
    assert array_bytes("(f32[4,8]{1,0}, bf16[4,8]{1,0})") == [("f32[4,8]", 128), ("bf16[4,8]", 64)]
    assert array_bytes("pred[]") == [("pred[]", 1)]


def test_peak_by_hand():
    p = peak(HLO)
    # arguments a (128 B) and b (512 B); schedule: f (0..) g0 g1 mm r c x t. Buffers: f#0 128 B live to mm
    # (step 5), f#1 64 B to c (step 7), mm#0 256 B to the end (the root's, through r and x), mm#1 1024 B (a
    # workspace nothing reads: its own step), c 128 B to the end. At mm (step 5): 128 + 64 + 256 + 1024.
    assert (p.arguments, p.steps) == (640, 10)
    assert (p.peak, p.at, p.instruction) == (128 + 64 + 256 + 1024, 5, "dot_general")
    assert sorted(p.live) == sorted([(1024, "s8[1024]", "dot_general"), (256, "f32[4,16]", "dot_general"),
                                     (128, "f32[4,8]", "tanh"), (64, "bf16[4,8]", "tanh")])
    assert grouped(p)[0] == (1024, 1, "s8[1024]", "dot_general")
