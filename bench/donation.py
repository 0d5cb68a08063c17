"""t2t_jax's train step with its state donated and not, interleaved in one process.

  python bench/donation.py                          # base and m30k, on this machine's backend
  python bench/donation.py --shapes=tiny --rounds=1 --steps=1

On the CPU `build.donated_state` does not donate the step's state (docs/performance.md, "What
makes the step fast"). This times that choice: the same config built twice, once as the
product builds it and once with the state donated, both stepping the same batch from the same
initial state. Each round runs both sides --steps steps (A, B, then B, A, ...) and times a
float32 2048^3 matmul; a side's round figure is the median of its steps. One JSON line per
shape (stdout): each side's step seconds per round, their ratio (donated over not: above 1,
not donating is faster), the matmul's FLOP/s per round, the weight copies each compiled
program makes, and whether both ended on the same state, bit for bit.
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
from t2t_jax.training import build  # pylint: disable=g-import-not-at-top,wrong-import-position


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  flags.DEFINE_list('shapes', ['base', 'm30k'], f'Comma-separated, from {sorted(common.SHAPES)}.',
                    flag_values=flag_values)
  flags.DEFINE_integer('rounds', 6, 'Interleaved rounds.', flag_values=flag_values)
  flags.DEFINE_integer('steps', 3, 'Steps per side and round.', flag_values=flag_values)


def parse_flags(argv: list[str]) -> flags.FlagValues:
  """`argv` (flags only) parsed into flag values of their own."""
  return common.own_flags(define_flags, 'donation.py', argv)


def _side(shape: common.Shape, donated: bool, batch: dict) -> compare.Side:
  """compare.py's t2t_jax side, its state donated or as the product builds it."""
  config = compare.shape_config(shape, compare.parse_flags(['compare.py']))
  product = build.donated_state
  if donated:
    build.donated_state = lambda platform: (0,)
  try:
    return compare.t2t_side(config, shape, batch, shape.rows, shape.length)
  finally:
    build.donated_state = product


def time_shape(name: str, args, matmul: common.Matmul) -> dict:
  """Both sides of one shape, interleaved over --rounds."""
  shape = common.SHAPES[name]
  batch = compare.make_batch(shape, shape.rows, shape.length)
  sides = {'donated': _side(shape, True, batch), 'not_donated': _side(shape, False, batch)}
  copies = {key: side.compiled.as_text().count('copy(%state_params')
            for key, side in sides.items()}
  for side in sides.values():
    side.step()
  seconds = {key: [] for key in sides}
  rates = []
  for round_index in range(args.rounds):
    order = list(sides) if round_index % 2 == 0 else list(sides)[::-1]
    for key in order:
      seconds[key].append(common.median_seconds(sides[key].step, args.steps, warmup=0))
    rates.append(matmul.flops_per_second())
  ratios = [d / n for d, n in zip(seconds['donated'], seconds['not_donated'])]
  same = all(np.array_equal(a, b) for a, b in zip(
      jax.tree.leaves(jax.device_get(sides['donated'].state)),
      jax.tree.leaves(jax.device_get(sides['not_donated'].state))))
  return {'benchmark': 'donation', 'shape': name, 'platform': jax.devices()[0].platform,
          'rounds': args.rounds, 'steps_per_round': args.steps,
          'step_seconds': {key: [round(s, 5) for s in v] for key, v in seconds.items()},
          'ratio_per_round': [round(r, 4) for r in ratios],
          'ratio_median': round(statistics.median(ratios), 4),
          'matmul_flops_per_second': rates, 'weight_copies': copies,
          'same_state_bit_for_bit': same}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  matmul = common.Matmul(2048, jnp.float32)
  for name in flags.FLAGS.shapes:
    print(cli.json_line(time_shape(name, flags.FLAGS, matmul)), flush=True)


if __name__ == '__main__':
  define_flags()
  cli.run(main, compilation_cache=None)
