"""hlo_cost: FLOPs, memory traffic and collectives of compiled programs, loops counted.

Programs are compiled for the 8 simulated CPU devices; the expectations are counted by hand
from the shapes (2 FLOPs per multiply-add, 4 bytes per float32).
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

from t2t_jax.compile import hlo_cost
from t2t_jax.compile import hlo_text
from t2t_jax.compile import roofline
from t2t_jax.compile import targets


def _cost(fn, *args, devices=1):
  compiled = jax.jit(fn).lower(*args).compile()
  return hlo_cost.analyse(compiled.as_text(), devices), compiled


def _f32(*shape):
  return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_a_matmul_costs_2mnk_flops_and_reads_and_writes_its_arrays_once():
  cost, _ = _cost(lambda a, b: a @ b, _f32(64, 128), _f32(128, 32))
  assert cost.flops == 2 * 64 * 128 * 32
  assert cost.hbm_bytes == 4 * (64 * 128 + 128 * 32 + 64 * 32)
  assert cost.collectives == [] and cost.unknown_trip_counts == 0


def test_a_scanned_loop_counts_its_body_once_per_trip_where_xla_counts_it_once():
  weights = _f32(6, 128, 128)

  def layers(x, w):
    return jax.lax.scan(lambda h, w_i: (jnp.tanh(h @ w_i), None), x, w)[0]

  cost, compiled = _cost(layers, _f32(32, 128), weights)
  one_layer = 2 * 32 * 128 * 128
  assert cost.flops == 6 * one_layer and cost.unknown_trip_counts == 0
  xla = compiled.cost_analysis()
  xla = xla[0] if isinstance(xla, (list, tuple)) else xla
  assert xla['flops'] < 2 * one_layer  # XLA's own analysis: the body once.
  # Each trip reads its layer's slice of the stacked weights, not the whole stack: more than
  # every layer read once, less than the whole stack read on every trip.
  stack = 6 * 4 * 128 * 128
  assert stack < cost.hbm_bytes < 6 * stack


def test_a_convolution_counts_only_the_window_taps_that_meet_the_input():
  # Length 10, kernel 3, 'SAME' padding: the two edge outputs see 2 taps, the others 3.
  def conv(x, k):
    return jax.lax.conv_general_dilated(x, k, (1,), 'SAME', dimension_numbers=('NWC', 'WIO',
                                                                                'NWC'))
  cost, _ = _cost(conv, _f32(4, 10, 16), _f32(3, 16, 8))
  taps = 10 * 3 - 2
  assert cost.flops == 2 * 4 * 8 * 16 * taps


def _mesh(shape, names):
  return jax.make_mesh(shape, names, devices=jax.devices()[:int(np.prod(shape))])


def _sharded(mesh, shape, spec):
  return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))


@pytest.mark.parametrize('name, body, kind, operand, wire', [
    ('psum', lambda x: jax.lax.psum(x, 'x'), 'all-reduce', 4096, 2 * 7 / 8 * 4096),
    ('all_gather', lambda x: jax.lax.all_gather(x, 'x'), 'all-gather', 4096, 7 * 4096),
    ('psum_scatter', lambda x: jax.lax.psum_scatter(x, 'x', tiled=True), 'reduce-scatter',
     4096, 7 / 8 * 4096),
    ('ppermute', lambda x: jax.lax.ppermute(x, 'x', [(i, (i + 1) % 8) for i in range(8)]),
     'collective-permute', 4096, 4096),
])
def test_collectives_are_found_with_their_bytes_and_groups(name, body, kind, operand, wire):
  del name
  mesh = _mesh((8,), ('x',))
  fn = jax.shard_map(body, mesh=mesh, in_specs=P('x'), out_specs=P('x'), check_vma=False)
  cost, _ = _cost(fn, _sharded(mesh, (8 * 1024,), P('x')), devices=8)
  (collective,) = cost.collectives
  assert (collective.kind, collective.operand_bytes, collective.count) == (kind, operand, 1)
  assert collective.wire_bytes == pytest.approx(wire)
  members = sorted(d for group in collective.groups for d in group)
  assert members == list(range(8)) or kind == 'collective-permute'


def test_a_collective_over_one_mesh_axis_groups_the_devices_along_it():
  mesh = _mesh((2, 4), ('slow', 'fast'))
  x = _sharded(mesh, (2, 4, 256), P('slow', 'fast'))
  over_fast = jax.shard_map(lambda v: jax.lax.psum(v, 'fast'), mesh=mesh,
                            in_specs=P('slow', 'fast'), out_specs=P('slow', 'fast'))
  over_slow = jax.shard_map(lambda v: jax.lax.psum(v, 'slow'), mesh=mesh,
                            in_specs=P('slow', 'fast'), out_specs=P('slow', 'fast'))
  fast, _ = _cost(over_fast, x, devices=8)
  slow, _ = _cost(over_slow, x, devices=8)
  ids = [d.id for d in mesh.devices.flat]
  position = {device_id: i for i, device_id in enumerate(ids)}
  assert sorted(sorted(position[d] for d in g) for g in fast.collectives[0].groups) == [
      [0, 1, 2, 3], [4, 5, 6, 7]]
  assert sorted(sorted(position[d] for d in g) for g in slow.collectives[0].groups) == [
      [0, 4], [1, 5], [2, 6], [3, 7]]
  # Two "hosts" of 4: only the collective over 'slow' crosses between them.
  target = targets.parse('gpu:2xh100x4')
  granules = [i // 4 for i in range(8)]
  assert roofline.predict(fast, target, granules).network_collective_seconds == 0
  crossing = roofline.predict(slow, target, granules)
  assert crossing.network_collective_seconds == crossing.collective_seconds > 0
  bytes_on_wire = 2 * 1 / 2 * 4 * 256  # All-reduce of 1 KiB among 2.
  assert crossing.collective_seconds == pytest.approx(
      bytes_on_wire / target.chip.network_bandwidth)


@pytest.mark.parametrize('attributes, expected', [
    ("replica_groups={{0,1},{2,3}}, to_apply=%add", [[0, 1], [2, 3]]),
    ("replica_groups=[2,4]<=[8], to_apply=%add", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true",
     [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true",
     [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}, x=1",
     [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("replica_groups={}, to_apply=%add", [list(range(8))]),
    ("source_target_pairs={{0,1},{1,0}}, channel_id=1", [[0, 1], [1, 0]]),
])
def test_replica_groups_in_each_printed_form(attributes, expected):
  assert hlo_text.replica_groups(attributes, 8) == expected


def test_roofline_takes_the_longer_of_compute_and_memory_per_kernel():
  target = targets.parse('tpu:v5e-8')
  chip = target.chip
  compute_bound = hlo_cost.Kernel('a', 'fusion', 197e12 * 1e-3, 819e9 * 1e-4, 'bf16', 2)
  memory_bound = hlo_cost.Kernel('b', 'fusion', 197e12 * 1e-4, 819e9 * 1e-3, 'bf16', 3)
  cost = hlo_cost.ProgramCost([compute_bound, memory_bound], [], 0)
  prediction = roofline.predict(cost, target, [0] * 8)
  assert roofline.peak(chip, 'bf16') == 197e12 and chip.memory_bandwidth == 819e9
  assert prediction.kernel_seconds == pytest.approx(2 * 1e-3 + 3 * 1e-3)
  assert prediction.compute_seconds == pytest.approx(2 * 1e-3 + 3 * 1e-4)
  assert prediction.memory_seconds == pytest.approx(2 * 1e-4 + 3 * 1e-3)
  assert prediction.step_seconds == prediction.kernel_seconds
  rates = roofline.throughput(prediction, 1000, 8 * 197e12 * 2.5e-3, target, 'bfloat16')
  assert rates['target_tokens_per_second'] == round(1000 / 5e-3)
  assert rates['mfu'] == pytest.approx(0.5)


def test_a_trip_count_the_hlo_cannot_give_is_counted_once_and_reported():
  def until_small(x):
    return jax.lax.while_loop(lambda v: v.sum() > 1.0, lambda v: (v @ v) * 0.5, x)
  cost, _ = _cost(until_small, _f32(16, 16))
  assert cost.unknown_trip_counts == 1
  assert cost.flops == 2 * 16 ** 3


def test_arrays_of_a_shape_with_layouts_tiles_and_memory_spaces():
  shape = ('(f32[2,3]{1,0:T(8,128)}, bf16[4]{0:T(128)S(1)}, /*index=2*/s32[], '
           'pred[5]{0})')
  assert hlo_text.arrays(shape) == [('f32', (2, 3), 0), ('bf16', (4,), 1), ('s32', (), 0),
                                    ('pred', (5,), 0)]
  assert hlo_text.hbm_bytes(shape) == 24 + 4 + 5  # The bf16 array is in another memory.
  assert hlo_text.total_bytes(shape) == 24 + 8 + 4 + 5


def test_both_branches_of_a_conditional_are_counted():
  def branchy(p, a, b):
    return jax.lax.cond(p, lambda: a @ b, lambda: (a @ b) @ b.T[:, :64] @ b)
  cost, _ = _cost(branchy, jax.ShapeDtypeStruct((), jnp.bool_), _f32(64, 64), _f32(64, 64))
  assert cost.flops == 4 * 2 * 64**3  # One matmul in one branch, three in the other.


def test_an_asynchronous_copy_moves_the_bytes_of_its_destination_and_its_source_once():
  """A prefetch from HBM into another memory reads HBM once and writes none of it; an
  eviction reads none and writes HBM once ((destination, source alias, context) is the
  copy-start's shape)."""
  hlo = '''HloModule copies

ENTRY %main (p: f32[256,256], q: f32[128,128]) -> (f32[256,256], f32[128,128]) {
  %p = f32[256,256]{1,0} parameter(0)
  %q = f32[128,128]{1,0:S(1)} parameter(1)
  %prefetch = (f32[256,256]{1,0:S(1)}, f32[256,256]{1,0}, u32[]) copy-start(%p)
  %near = f32[256,256]{1,0:S(1)} copy-done(%prefetch)
  %evict = (f32[128,128]{1,0}, f32[128,128]{1,0:S(1)}, u32[]) copy-start(%q)
  %far = f32[128,128]{1,0} copy-done(%evict)
  ROOT %out = (f32[256,256]{1,0:S(1)}, f32[128,128]{1,0}) tuple(%near, %far)
}
'''
  kernels = {k.name: k.hbm_bytes for k in hlo_cost.analyse(hlo, 1).kernels}
  assert kernels['prefetch'] == 256 * 256 * 4  # Read from HBM, written elsewhere.
  assert kernels['evict'] == 128 * 128 * 4  # Read elsewhere, written to HBM.


def test_an_asynchronous_slice_reads_its_slice_and_every_memory_counts_the_on_chip_bytes():
  """A TPU's slice-start fetches one piece of a weight into VMEM (S(1)): it reads that piece
  from HBM, not the whole weight. With every_memory (as XLA's TPU 'bytes accessed') its write
  to VMEM and the on-chip add count too."""
  hlo = '''HloModule slices

ENTRY %main (w: f32[512,8,64]) -> f32[512,2,64] {
  %w = f32[512,8,64]{0,2,1} parameter(0)
  %start = ((f32[512,8,64]{0,2,1}), f32[512,2,64]{0,2,1:S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:512], [6:8], [0:64]}
  %piece = f32[512,2,64]{0,2,1:S(1)} slice-done(%start)
  ROOT %sum = f32[512,2,64]{0,2,1} add(%piece, %piece)
}
'''
  piece = 512 * 2 * 64 * 4
  kernels = {k.name: k.hbm_bytes for k in hlo_cost.analyse(hlo, 1).kernels}
  assert kernels == {'start': piece, 'sum': piece}  # The add writes HBM, reads VMEM.
  every = {k.name: k.hbm_bytes for k in hlo_cost.analyse(hlo, 1, every_memory=True).kernels}
  assert every == {'start': 2 * piece + 4, 'sum': 3 * piece}  # And the s32 context.


def test_fp8_arrays_have_one_byte_an_element_and_slice_sends_their_operand_once():
  assert hlo_text.total_bytes('(f8e4m3fn[4,8]{1,0}, f8e5m2[16]{0})') == 32 + 16
  send = hlo_cost.Collective('one-to-one', 1000.0, [], 1, 2)
  assert send.wire_bytes == 1000.0


@pytest.mark.parametrize('op_name, part', [
    ('jit(train_step)/jvp(Transformer)/Transformer.encode/encoder_3/attention_block/norm/mul',
     'layer norms'),
    ('jit(train_step)/transpose(jvp(Transformer))/Transformer.decode/decoder_0/'
     'cross_attention_block/cross_attention/dot_general', 'attention'),
    ('jit(train_step)/jvp(Transformer)/Transformer.encode/encoder_5/ffn_block/ffn/wi/dot_general',
     'feed-forward'),
    ('jit(train_step)/transpose(jvp(Transformer))/Transformer.encode/source_embedder/embedding/'
     'jit(_take)/scatter-add', 'embedding'),
    ('jit(train_step)/jvp()/while/body/closed_call/transpose(jvp(Transformer.output_logits))/'
     'embedding.attend/dot_general', 'loss'),
    ('jit(train_step)/jvp()/loss/while/body/closed_call/reduce_sum', 'loss'),
    ('jit(train_step)/optimizer/sqrt', 'optimiser'),
    ('jit(train_step)/xor', 'other'), ('', 'other')])
def test_a_kernel_belongs_to_the_part_its_op_name_names(op_name, part):
  assert hlo_cost.part_of(op_name) == part


def test_bytes_by_part_add_up_and_a_copy_is_charged_to_its_user():
  """Each part's kernels are those its named scope made, a fused kernel with a matmul the
  matmul's (the CPU fuses the loss into it); the parts' bytes add up to the program's; a
  copy with no metadata of its own belongs to the kernel that uses it."""
  def step(x, w):
    with jax.named_scope('attention'):
      h = jnp.tanh(x @ w)
    with jax.named_scope('loss'):
      loss = jnp.sum(h * h)
    with jax.named_scope('optimizer'):
      return loss, w - 0.1 * jnp.exp(w)
  cost, _ = _cost(step, _f32(64, 128), _f32(128, 128))
  target = targets.parse('gpu:h100x8')
  parts = roofline.by_part(cost, target)
  assert set(parts) <= set(hlo_cost.PARTS) and {'attention', 'optimiser'} <= set(parts)
  assert sum(row['hbm_bytes'] for row in parts.values()) == pytest.approx(cost.hbm_bytes,
                                                                           rel=1e-3)
  # Its only matmul (the CPU fuses the loss into it: the kernel is the matmul's).
  assert parts['attention']['flops'] == pytest.approx(2 * 64 * 128 * 128, rel=1e-3)
  # The update reads and writes the weight at least once.
  assert parts['optimiser']['hbm_bytes'] >= 2 * 128 * 128 * 4
  heaviest = roofline.heaviest(cost, target, n=3)
  assert len(heaviest) == min(3, len(cost.kernels))
  assert [k['seconds'] for k in heaviest] == sorted((k['seconds'] for k in heaviest),
                                                    reverse=True)
  hlo = '''HloModule copies

ENTRY %main (p: f32[256,256]) -> f32[256,256] {
  %p = f32[256,256]{1,0} parameter(0)
  %prefetch = (f32[256,256]{1,0:S(1)}, f32[256,256]{1,0}, u32[]) copy-start(%p)
  %near = f32[256,256]{1,0:S(1)} copy-done(%prefetch)
  ROOT %out = f32[256,256]{1,0} fusion(%near), kind=kLoop, calls=%f, metadata={op_name="jit(step)/ffn/wi/mul"}
}

%f (a: f32[256,256]) -> f32[256,256] {
  %a = f32[256,256]{1,0:S(1)} parameter(0)
  ROOT %m = f32[256,256]{1,0} multiply(%a, %a)
}
'''
  kernels = {k.name: k.part for k in hlo_cost.analyse(hlo, 1).kernels}
  assert kernels == {'prefetch': 'feed-forward', 'out': 'feed-forward'}


_SCHEDULED = '''HloModule scheduled, is_scheduled=true

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (p: f32[1024,1024], x: f32[ROWS,1024], v: f32[262144]) -> (f32[1024,1024], f32[GATHERED,1024], f32[262144]) {
  %p = f32[1024,1024]{1,0} parameter(0)
  %x = f32[ROWS,1024]{1,0} parameter(1)
  %v = f32[262144]{0} parameter(2)
  %first = f32[1024,1024]{1,0} add(%p, %p)
  %gather = (f32[ROWS,1024]{1,0}, f32[GATHERED,1024]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
  %between = f32[1024,1024]{1,0} multiply(%first, %first)
  %gathered = f32[GATHERED,1024]{1,0} all-gather-done(%gather)
  %after = f32[1024,1024]{1,0} subtract(%between, %p)
  %reduced = f32[262144]{0} all-reduce(%v), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%sum
  ROOT %out = (f32[1024,1024]{1,0}, f32[GATHERED,1024]{1,0}, f32[262144]{0}) tuple(%after, %gathered, %reduced)
}
'''


@pytest.mark.parametrize('rows', [8, 512])
def test_an_asynchronous_collective_runs_beside_the_kernels_scheduled_inside_it(rows):
  """An all-gather's start and done with one kernel between them: the step pays only what the
  gather takes beyond that kernel; a blocking all-reduce is paid in full. Each kernel of the
  program reads two and writes one 4 MiB array."""
  hlo = _SCHEDULED.replace('ROWS', str(rows)).replace('GATHERED', str(8 * rows))
  target = targets.parse('gpu:h100x8')
  chip = target.chip
  cost = hlo_cost.analyse(hlo, 8)
  prediction = roofline.predict(cost, target, [0] * 8)
  kernel = 3 * 4 * 2**20 / chip.memory_bandwidth  # Each of first, between, after.
  gather = 7 * rows * 1024 * 4 / chip.interconnect_bandwidth  # Its piece to 7 others.
  reduce = 2 * 7 / 8 * 262144 * 4 / chip.interconnect_bandwidth  # A ring all-reduce.
  assert prediction.kernel_seconds == pytest.approx(3 * kernel)
  assert prediction.collective_seconds == pytest.approx(gather + reduce)
  # first, then 'between' beside the gather, then after; the all-reduce after all of them.
  assert prediction.step_seconds == pytest.approx(kernel + max(kernel, gather) + kernel + reduce)
  assert prediction.overlapped_collective_seconds == pytest.approx(min(kernel, gather))
  assert (gather < kernel) == (rows == 8)  # Both cases: hidden whole, and outlasting it.
  # Without the schedule (a cost built by hand), every collective is in series.
  serial = roofline.predict(hlo_cost.ProgramCost(cost.kernels, cost.collectives, 0), target,
                            [0] * 8)
  assert serial.step_seconds == pytest.approx(3 * kernel + gather + reduce)


def test_collectives_share_the_links_and_an_async_wrapper_is_asynchronous():
  """Two all-gathers started together take the links one after the other, and a collective
  wrapped in async-start / async-done (as TPU programs print them) overlaps like a start and
  done pair."""
  hlo = '''HloModule two, is_scheduled=true

%gather_body (y: f32[512,1024]) -> f32[4096,1024] {
  %y = f32[512,1024]{1,0} parameter(0)
  ROOT %g = f32[4096,1024]{1,0} all-gather(%y), channel_id=2, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}

ENTRY %main (p: f32[1024,1024], x: f32[512,1024], y: f32[512,1024]) -> (f32[1024,1024], f32[4096,1024], f32[4096,1024]) {
  %p = f32[1024,1024]{1,0} parameter(0)
  %x = f32[512,1024]{1,0} parameter(1)
  %y = f32[512,1024]{1,0} parameter(2)
  %one = (f32[512,1024]{1,0}, f32[4096,1024]{1,0}) all-gather-start(%x), channel_id=1, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %two = ((f32[512,1024]{1,0}), f32[4096,1024]{1,0}, u32[]) async-start(%y), calls=%gather_body
  %work = f32[1024,1024]{1,0} add(%p, %p)
  %one_done = f32[4096,1024]{1,0} all-gather-done(%one)
  %two_done = f32[4096,1024]{1,0} async-done(%two), calls=%gather_body
  ROOT %out = (f32[1024,1024]{1,0}, f32[4096,1024]{1,0}, f32[4096,1024]{1,0}) tuple(%work, %one_done, %two_done)
}
'''
  target = targets.parse('gpu:h100x8')
  prediction = roofline.predict(hlo_cost.analyse(hlo, 8), target, [0] * 8)
  kernel = 3 * 4 * 2**20 / target.chip.memory_bandwidth
  gather = 7 * 512 * 1024 * 4 / target.chip.interconnect_bandwidth
  assert prediction.step_seconds == pytest.approx(max(kernel, 2 * gather))
  assert prediction.overlapped_collective_seconds == pytest.approx(
      kernel + 2 * gather - max(kernel, 2 * gather))


def test_a_fusion_reads_only_what_its_slice_needs_through_a_reduction():
  """A split-K weight gradient's partial sums [4, 96, 32] summed, cast and sliced to a third
  inside one loop fusion: XLA computes the fusion per output element, so only a third of the
  partials is read; a second operand used whole is read whole."""
  hlo = '''HloModule sliced

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused (p0: f32[4,96,32], p1: bf16[32,32]) -> bf16[32,32] {
  %p0 = f32[4,96,32]{2,1,0} parameter(0)
  %p1 = bf16[32,32]{1,0} parameter(1)
  %zero = f32[] constant(0)
  %summed = f32[96,32]{1,0} reduce(%p0, %zero), dimensions={0}, to_apply=%sum
  %cast = bf16[96,32]{1,0} convert(%summed)
  %third = bf16[32,32]{1,0} slice(%cast), slice={[32:64], [0:32]}
  ROOT %out = bf16[32,32]{1,0} add(%third, %p1)
}

ENTRY %main (x: f32[4,96,32], y: bf16[32,32]) -> bf16[32,32] {
  %x = f32[4,96,32]{2,1,0} parameter(0)
  %y = bf16[32,32]{1,0} parameter(1)
  ROOT %f = bf16[32,32]{1,0} fusion(%x, %y), kind=kLoop, calls=%fused
}
'''
  (kernel,) = hlo_cost.analyse(hlo, 1).kernels
  assert kernel.hbm_bytes == 4 * 32 * 32 * 4 + 32 * 32 * 2 + 32 * 32 * 2


def test_collectives_that_libtpu_fuses_are_counted_once_and_overlap_like_a_start_and_done():
  """libtpu's form: an all-gather started by a fusion whose root is an AsyncCollectiveStart
  custom call, carried on by a compute fusion holding the same channel, waited for by an
  AsyncCollectiveDone fusion: one all-gather, beside the kernel between. Its reduce-scatter is
  an all-reduce fused with the dynamic-slice each device keeps: counted as a reduce-scatter,
  (n - 1) / n of its operand on the wire, which the step waits for."""
  gather = ("all-gather(%p), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, "
            "use_global_device_ids=true")
  hlo = f'''HloModule fused_collectives, is_scheduled=true

%sum (a: f32[], b: f32[]) -> f32[] {{
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}}

%start_body (p: f32[512,1024]) -> (f32[512,1024], f32[4096,1024]) {{
  %p = f32[512,1024]{{1,0}} parameter(0)
  %g = f32[4096,1024]{{1,0}} {gather}
  ROOT %c = (f32[512,1024]{{1,0:S(1)}}, f32[4096,1024]{{1,0:S(1)}}) custom-call(%p, %g), custom_call_target="AsyncCollectiveStart"
}}

%carry_body (p: f32[512,1024], q: f32[1024,1024]) -> (f32[1024,1024], f32[4096,1024]) {{
  %p = f32[512,1024]{{1,0}} parameter(0)
  %q = f32[1024,1024]{{1,0}} parameter(1)
  %g = f32[4096,1024]{{1,0}} {gather}
  %w = f32[1024,1024]{{1,0}} add(%q, %q)
  ROOT %t = (f32[1024,1024]{{1,0}}, f32[4096,1024]{{1,0:S(1)}}) tuple(%w, %g)
}}

%done_body (p: f32[512,1024], r: f32[4096,1024]) -> f32[4096,1024] {{
  %p = f32[512,1024]{{1,0}} parameter(0)
  %r = f32[4096,1024]{{1,0:S(1)}} parameter(1)
  %g = f32[4096,1024]{{1,0}} {gather}
  ROOT %d = f32[4096,1024]{{1,0:S(1)}} custom-call(%p, %r, %g), custom_call_target="AsyncCollectiveDone"
}}

%scatter_body (v: f32[262144]) -> f32[32768] {{
  %v = f32[262144]{{0}} parameter(0)
  %r = f32[262144]{{0}} all-reduce(%v), channel_id=9, replica_groups={{{{0,1,2,3,4,5,6,7}}}}, to_apply=%sum
  %i = u32[] partition-id()
  %k = u32[] constant(32768)
  %o = u32[] multiply(%i, %k)
  ROOT %s = f32[32768]{{0}} dynamic-slice(%r, %o), dynamic_slice_sizes={{32768}}
}}

ENTRY %main (x: f32[512,1024], q: f32[1024,1024], v: f32[262144]) -> (f32[1024,1024], f32[4096,1024], f32[32768]) {{
  %x = f32[512,1024]{{1,0:S(1)}} parameter(0)
  %q = f32[1024,1024]{{1,0}} parameter(1)
  %v = f32[262144]{{0:S(1)}} parameter(2)
  %start = (f32[512,1024]{{1,0:S(1)}}, f32[4096,1024]{{1,0:S(1)}}) fusion(%x), kind=kCustom, calls=%start_body
  %s0 = f32[512,1024]{{1,0:S(1)}} get-tuple-element(%start), index=0
  %s1 = f32[4096,1024]{{1,0:S(1)}} get-tuple-element(%start), index=1
  %carry = (f32[1024,1024]{{1,0}}, f32[4096,1024]{{1,0:S(1)}}) fusion(%s0, %q), kind=kLoop, calls=%carry_body
  %w = f32[1024,1024]{{1,0}} get-tuple-element(%carry), index=0
  %c1 = f32[4096,1024]{{1,0:S(1)}} get-tuple-element(%carry), index=1
  %done = f32[4096,1024]{{1,0:S(1)}} fusion(%s0, %c1), kind=kCustom, calls=%done_body
  %scattered = f32[32768]{{0:S(1)}} fusion(%v), kind=kLoop, calls=%scatter_body
  ROOT %out = (f32[1024,1024]{{1,0}}, f32[4096,1024]{{1,0:S(1)}}, f32[32768]{{0:S(1)}}) tuple(%w, %done, %scattered)
}}
'''
  target = targets.parse('tpu:v5e-8')
  cost = hlo_cost.analyse(hlo, 8)
  assert cost.collectives_by_kind() == {
      'all-gather': {'count': 1, 'bytes': 512 * 1024 * 4, 'wire_bytes': 7 * 512 * 1024 * 4},
      'reduce-scatter': {'count': 1, 'bytes': 262144 * 4, 'wire_bytes': 7 / 8 * 262144 * 4}}
  prediction = roofline.predict(cost, target, [0] * 8)
  chip = target.chip
  carried = 2 * 4 * 2**20 / chip.memory_bandwidth  # The carrying fusion: q read, w written.
  gather = 7 * 512 * 1024 * 4 / chip.interconnect_bandwidth
  scatter = 7 / 8 * 262144 * 4 / chip.interconnect_bandwidth
  assert prediction.kernel_seconds == pytest.approx(carried)  # The rest is on chip (S(1)).
  assert prediction.step_seconds == pytest.approx(max(carried, gather) + scatter)
