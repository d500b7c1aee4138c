"""Stress test (d) of issue 15 where it can run without a GPU: jodc's custom calls reach the optimized HLO as typed-FFI
calls with side effects, and the checker that the GPU test uses to find calls captured into command buffers reads
XLA's HLO correctly (on a real module, and on a synthetic one with a command buffer)."""
import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from conftest import cpu_mesh
from jodc import ops
import hlo_check  # tools/ (conftest puts it on the path)

SYNTHETIC = """HloModule m, is_scheduled=true

%inner (p: s32[]) -> s32[] {
  %p = s32[] parameter(0)
  ROOT %c = s32[] custom-call(%p), custom_call_target="jodc_after", custom_call_has_side_effect=true, api_version=API_VERSION_TYPED_FFI
}

%command_buffer.2 (a: f32[8], t: s32[]) -> (f32[8], s32[]) {
  %a = f32[8]{0} parameter(0)
  %t = s32[] parameter(1)
  %g = (f32[8]{0}, s32[]) custom-call(%t, %t), custom_call_target="jodc_gather", custom_call_has_side_effect=true, api_version=API_VERSION_TYPED_FFI
  %k = s32[] call(%t), to_apply=%inner
  ROOT %r = (f32[8]{0}, s32[]) tuple(%a, %k)
}

ENTRY %main (x: f32[8], t: s32[]) -> s32[] {
  %x = f32[8]{0} parameter(0)
  %t = s32[] parameter(1)
  %b = s32[] custom-call(%t, %t), custom_call_target="jodc_barrier", custom_call_has_side_effect=true, api_version=API_VERSION_TYPED_FFI
  %cb = (f32[8]{0}, s32[]) call(%x, %b), to_apply=%command_buffer.2
  ROOT %o = s32[] get-tuple-element(%cb), index=1
}
"""


def test_checker_finds_calls_inside_command_buffers_and_their_callees():
    total, captured = hlo_check.jodc_calls_in_command_buffers(SYNTHETIC)
    assert total == 3
    assert captured == [("command_buffer.2", "jodc_gather"), ("inner", "jodc_after")]
    assert set(hlo_check.computations(SYNTHETIC)) == {"inner", "command_buffer.2", "main"}
    assert hlo_check.command_buffer_count(SYNTHETIC) == 1
    assert hlo_check.command_buffer_count(SYNTHETIC.replace("command_buffer.2", "fused_thing")) == 0


def test_compiled_ops_are_side_effecting_typed_ffi_calls_outside_command_buffers():
    mesh = cpu_mesh(2)
    with ops.SymmetricHeap(mesh) as heap:
        b = heap.register(64)

        def body(x):
            def step(i, tok):
                full, tok = ops.gather(b, tok)
                return ops.scatter_accumulate(b, jnp.tanh(full) * x[0], tok)

            tok = lax.fori_loop(0, 3, step, ops.new_token())
            tok = ops.barrier(heap, tok)
            acc, tok = ops.read_accumulator(b, tok)
            tok = ops.zero_accumulator(b, tok)
            tok = ops.publish(b, acc, tok)
            return ops.depend_on(acc, ops.after(tok, acc))

        sm = jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        text = jax.jit(sm).lower(jnp.ones(2)).compile().as_text()
    calls = hlo_check.jodc_custom_calls(text)
    targets = {c["target"] for c in calls}
    assert {"jodc_gather", "jodc_scatter_accumulate", "jodc_barrier", "jodc_read_accumulator",
            "jodc_zero_accumulator", "jodc_publish", "jodc_after", "jodc_depend_on"} <= targets
    assert all(c["has_side_effect"] and c["api_version"] == "API_VERSION_TYPED_FFI" for c in calls), calls
    # the gather and scatter stay inside the loop body (not hoisted out next to the barrier)
    where = {c["target"]: c["computation"] for c in calls}
    assert where["jodc_gather"] == where["jodc_scatter_accumulate"] != where["jodc_barrier"], where
    total, captured = hlo_check.jodc_calls_in_command_buffers(text)
    assert total == len(calls) and captured == []
    assert hlo_check.command_buffer_count(text) == 0  # the CPU backend forms none: the GPU test skips on 0
