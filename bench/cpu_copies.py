"""The CPU train step's in-place update: the step compiled with region analysis beside the same
step with XLA's usual copy insertion, and beside it not donated, interleaved in one process.

  python bench/cpu_copies.py                        # base, m30k and small
  python bench/cpu_copies.py --shapes=tiny --rounds=1 --steps=1

On one CPU device XLA's usual copy insertion copies each donated weight at the step's start;
with region analysis the update writes in place. t2t_jax takes region analysis for steps with
at least runtime.CPU_IN_PLACE_WEIGHT_BYTES of weights (runtime.train_compiler_options). Three
sides of one config, stepping the same batch from the same initial state: 'in_place' (region
analysis), 'usual' (donated, without it) and 'not_donated' (without either: fresh buffers,
the state held twice). Each round runs the sides --steps steps in turn (forwards, then
backwards) and times a float32 2048^3 matmul; a side's round figure is the median of its
steps. One JSON line per shape (stdout): which side the product compiles, each side's step
seconds per round, its speed-up over 'usual' per round and their median, the weight copies
each compiled program makes, the matmul's FLOP/s per round, and whether the three ended on
the same state, bit for bit.
"""

import os
import statistics
import sys

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top,wrong-import-position
import compare  # pylint: disable=g-import-not-at-top,wrong-import-position

from t2t_jax import cli  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax import runtime  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax import sharding  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.training import build  # pylint: disable=g-import-not-at-top,wrong-import-position
from t2t_jax.training import train  # pylint: disable=g-import-not-at-top,wrong-import-position


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  flags.DEFINE_list('shapes', ['base', 'm30k', 'small'],
                    f'Comma-separated, from {sorted(common.SHAPES)}.', flag_values=flag_values)
  flags.DEFINE_integer('rounds', 6, 'Interleaved rounds.', flag_values=flag_values)
  flags.DEFINE_integer('steps', 3, 'Steps per side and round.', flag_values=flag_values)


def parse_flags(argv: list[str]) -> flags.FlagValues:
  """`argv` (flags only) parsed into flag values of their own."""
  return common.own_flags(define_flags, 'cpu_copies.py', argv)


def _built(config, shape: common.Shape, mesh, threshold: int):
  """train.build's Setup with runtime.CPU_IN_PLACE_WEIGHT_BYTES at `threshold`."""
  product = runtime.CPU_IN_PLACE_WEIGHT_BYTES
  runtime.CPU_IN_PLACE_WEIGHT_BYTES = threshold
  try:
    return train.build(config, shape.vocab, mesh)
  finally:
    runtime.CPU_IN_PLACE_WEIGHT_BYTES = product


def _steps(config, shape: common.Shape, mesh, batch) -> tuple[dict, object]:
  """The three sides' compiled steps, and the in-place side's setup (init, abstract state)."""
  in_place = _built(config, shape, mesh, 0)
  usual = _built(config, shape, mesh, 2**62)
  key = jax.random.PRNGKey(1)
  # The usual step's jit inside one that donates nothing: the inner jit's donation is dropped.
  not_donated = build.traced(jax.jit(usual.train_step.__wrapped__), mesh, usual.axis_rules)
  jitted = {'in_place': in_place.train_step, 'usual': usual.train_step,
            'not_donated': not_donated}
  return {name: step.lower(in_place.abstract_state, batch, key).compile()
          for name, step in jitted.items()}, in_place


def time_shape(name: str, args, matmul: common.Matmul) -> dict:
  """The three sides of one shape, interleaved over --rounds."""
  if jax.devices()[0].platform != 'cpu':
    raise ValueError(f'cpu_copies.py times the CPU step; this backend is '
                     f'{jax.devices()[0].platform}: run it with JAX_PLATFORMS=cpu')
  shape = common.SHAPES[name]
  config = compare.shape_config(shape, compare.parse_flags(['compare.py']))
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  batch = sharding.global_batch(compare.make_batch(shape, shape.rows, shape.length), mesh)
  compiled, setup = _steps(config, shape, mesh, batch)
  key = jax.random.PRNGKey(1)
  states = {side: setup.init(jax.random.PRNGKey(0)) for side in compiled}

  def step(side):
    states[side], _ = compiled[side](states[side], batch, key)
    jax.block_until_ready(states[side])
  for side in compiled:
    step(side)
  seconds = {side: [] for side in compiled}
  rates = []
  for round_index in range(args.rounds):
    for side in list(compiled)[::1 if round_index % 2 == 0 else -1]:
      seconds[side].append(common.median_seconds(lambda side=side: step(side), args.steps,
                                                 warmup=0))
    rates.append(matmul.flops_per_second())
  speed_ups = {side: [u / s for u, s in zip(seconds['usual'], seconds[side])]
               for side in ('in_place', 'not_donated')}
  leaves = [jax.tree.leaves(jax.device_get(state)) for state in states.values()]
  weight_bytes = sharding.shard_bytes(setup.abstract_state.params)
  # The product's own rule says which side it compiles.
  product = runtime.train_compiler_options(config.mesh, 'cpu', weight_bytes=weight_bytes)
  return {'benchmark': 'cpu_copies', 'shape': name, 'weight_bytes': weight_bytes,
          'product_side': 'in_place' if product else 'usual',
          'rounds': args.rounds, 'steps_per_round': args.steps,
          'step_seconds': {side: [round(s, 5) for s in v] for side, v in seconds.items()},
          'speed_up_over_usual': {side: [round(r, 4) for r in v]
                                  for side, v in speed_ups.items()},
          'speed_up_median': {side: round(statistics.median(v), 4)
                              for side, v in speed_ups.items()},
          'weight_copies': {side: c.as_text().count('copy(%state_params')
                            for side, c in compiled.items()},
          'matmul_flops_per_second': rates,
          'same_state_bit_for_bit': all(all(np.array_equal(a, b) for a, b in zip(leaves[0], other))
                                        for other in leaves[1:])}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  matmul = common.Matmul(2048, jnp.float32)
  for name in flags.FLAGS.shapes:
    print(cli.json_line(time_shape(name, flags.FLAGS, matmul)), flush=True)


if __name__ == '__main__':
  define_flags()
  cli.run(main, compilation_cache=None)
