"""t2t_jax's train step beside Flax's WMT example (the reference), interleaved in one process.

  python bench/compare.py                                   # small, m30k, m30k_packed, base
  python bench/compare.py --shapes=m30k_packed --recipe=m30k
  python bench/compare.py --shapes=big --dtype=bfloat16     # on a GPU or TPU
  python bench/compare.py --shapes=small --t2t_override model.norm=post

The reference is imported from --reference_dir (Flax's examples/wmt: its models.py and
train.py), never copied. Each round runs both sides --steps steps (A, B, then B, A, ...) and
times a float32 2048^3 matmul; a side's round figure is the median of its steps. Prints one
JSON line per shape (stdout) and one line per round (stderr); docs/performance.md explains
the fields.

Equal work, by construction: both sides train on the same batch (random tokens without
padding; packed shapes carry the same segment ids and positions), pre-LN by default (the
reference is pre-LN), one embedding matrix shared by source, target and the output
projection, label smoothing, Adam's betas and epsilon, weight decay and the warmup length all
read from the t2t_jax config (0.1; 0.9, 0.98, 1e-9; 0; 4000 in configs/base.py), the
reference's linear-warmup rsqrt schedule scaled to peak where t2t_jax's does, float32
parameters and --dtype compute. The reference runs its own train.train_step (loss, gradient,
update and its metrics) jitted on one device, its pmean and psum bound to a size-1 axis (the
example runs it under pmap) so that no collective is left; t2t_jax runs its jitted step on a
1x1x1 mesh of the same device.

What differs unavoidably (it is the example's model and step):
  - the reference drops its feed-forward hidden units at its residual rate (it has no ReLU
    dropout knob): under --recipe=m30k it drops 0.3 there where t2t_jax drops nothing;
  - its tied output projection runs in float32 whatever the dtype (its shared embedding has
    no dtype), then casts the logits to the dtype; t2t_jax projects in the dtype and casts
    the logits to float32;
  - its loss multiplies a one-hot [B, L, V] target matrix; t2t_jax (opt.loss_chunk_tokens,
    512 by default) computes the loss and its gradient chunk by chunk of tokens; both also
    compute accuracy, t2t_jax the unsmoothed loss too;
  - it does not scale embeddings by sqrt(d_model), divides the logits by sqrt(d_model) instead,
    and (packed) does not restart the shifted decoder input at each segment;
  - initialisers differ (no effect on the work).
"""

import dataclasses
import functools
import os
import statistics
import sys
import time

from absl import app
from absl import flags
import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top
import flax_reference  # pylint: disable=g-import-not-at-top

from t2t_jax import cli
from t2t_jax import sharding
from t2t_jax.model import flops
from t2t_jax.training import train

# t2t_jax batch keys -> the reference's.
_REFERENCE_KEYS = {'inputs': 'inputs', 'targets': 'targets',
                   'inputs_positions': 'inputs_position', 'targets_positions': 'targets_position',
                   'inputs_segments': 'inputs_segmentation',
                   'targets_segments': 'targets_segmentation'}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
  """The command's flags, in `flag_values` (absl's global ones when run as a command)."""
  flags.DEFINE_list('shapes', ['small', 'm30k', 'm30k_packed', 'base'],
                    f'Comma-separated, from {sorted(common.SHAPES)}.', flag_values=flag_values)
  flags.DEFINE_integer('rows', 0, "Batch rows; 0: the shape's.", flag_values=flag_values)
  flags.DEFINE_integer('length', 0, "Row length; 0: the shape's.", flag_values=flag_values)
  flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'],
                    'Compute dtype of both sides (parameters stay float32).',
                    flag_values=flag_values)
  flags.DEFINE_float('dropout', 0.1, 'Residual dropout, both.', flag_values=flag_values)
  flags.DEFINE_float('attention_dropout', 0.1, 'Both sides.', flag_values=flag_values)
  flags.DEFINE_float('relu_dropout', 0.1, 't2t_jax only: the reference uses --dropout there.',
                     flag_values=flag_values)
  flags.DEFINE_enum('recipe', 'none', ['none', 'm30k'],
                    "m30k: configs/multi30k.py's dropout settings on both sides.",
                    flag_values=flag_values)
  flags.DEFINE_enum('norm', 'pre', ['pre', 'post'], 't2t_jax norm.', flag_values=flag_values)
  flags.DEFINE_multi_string('t2t_override', [], 'KEY=VALUE: sets a t2t_jax config key '
                            '(repeatable), e.g. model.norm=post.', flag_values=flag_values)
  flags.DEFINE_integer('rounds', 5, 'Interleaved rounds.', flag_values=flag_values)
  flags.DEFINE_integer('steps', 3, 'Timed steps per side and round.', flag_values=flag_values)
  flags.DEFINE_integer('warmup', 2, 'Untimed steps per side first.', flag_values=flag_values)
  flags.DEFINE_string('reference_dir', '../shared/anchor/flax_wmt',
                      "Flax's examples/wmt (models.py, train.py); relative to the cwd.",
                      flag_values=flag_values)

  def known_shapes(names):
    unknown = set(names) - set(common.SHAPES)
    if unknown:
      raise flags.ValidationError(f'unknown {sorted(unknown)}; choose from '
                                  f'{sorted(common.SHAPES)}')
    return True
  flags.register_validator('shapes', known_shapes, flag_values=flag_values)


def parse_flags(argv: list[str]) -> flags.FlagValues:
  """`argv` (flags only) parsed into flag values of their own, absl's global ones untouched."""
  return common.own_flags(define_flags, 'compare.py', argv)


def shape_config(shape: common.Shape, args):
  """The t2t_jax config of `shape` under the parsed flags `args` (dropout, recipe, norm, dtype
  and overrides)."""
  dropout = common.dropout_settings(args.recipe, args.dropout, args.attention_dropout,
                                    args.relu_dropout)
  return common.t2t_config(shape, dropout, args.norm, args.dtype, args.t2t_override)


def make_batch(shape: common.Shape, rows: int, length: int) -> dict[str, np.ndarray]:
  """Random tokens (no padding: ids from 3) in t2t_jax's keys, packing metadata if packed."""
  rng = np.random.default_rng(0)
  batch = {side: rng.integers(3, shape.vocab, (rows, length), dtype=np.int32)
           for side in ('inputs', 'targets')}
  if shape.packed_segments:
    for side in ('inputs', 'targets'):
      batch[f'{side}_segments'], batch[f'{side}_positions'] = _packing(
          rng, rows, length, shape.packed_segments)
  return batch


def _packing(rng, rows: int, length: int, segments: int) -> tuple[np.ndarray, np.ndarray]:
  """Segment ids (1..segments) and positions within each segment, cut at random places."""
  if length < segments:
    raise ValueError(f'--length={length} cannot hold {segments} packed segments per row')
  cuts_RC = np.sort(np.stack([rng.choice(np.arange(1, length), segments - 1, replace=False)
                              for _ in range(rows)]), axis=1)
  index_L = np.arange(length)
  segments_RL = 1 + (index_L[None, :, None] >= cuts_RC[:, None, :]).sum(-1)
  starts_RS = np.concatenate([np.zeros((rows, 1), np.int64), cuts_RC], axis=1)
  positions_RL = index_L[None] - np.take_along_axis(starts_RS, segments_RL - 1, axis=1)
  return segments_RL.astype(np.int32), positions_RL.astype(np.int32)


@dataclasses.dataclass
class Side:
  """One implementation's compiled step with its state, batch and what it costs."""
  name: str
  compiled: object
  state: object
  batch: dict
  rng: jax.Array
  compile_seconds: float
  xla_flops: float
  model_flops: float
  params: int
  nll: object  # metrics -> mean unsmoothed loss per target token.
  first_nll: float = float('nan')

  def step(self):
    self.state, metrics = self.compiled(self.state, self.batch, self.rng)
    jax.block_until_ready((self.state, metrics))
    return metrics


def t2t_side(config, shape: common.Shape, batch: dict, rows: int, length: int) -> Side:
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  setup = train.build(config, shape.vocab, mesh)
  device_batch = sharding.global_batch(batch, mesh)
  rng = jax.random.PRNGKey(1)
  start = time.perf_counter()
  compiled = setup.train_step.lower(setup.abstract_state, device_batch, rng).compile()
  compile_seconds = time.perf_counter() - start
  return Side('t2t_jax', compiled, setup.init(jax.random.PRNGKey(0)), device_batch, rng,
              compile_seconds, common.xla_flops(compiled),
              flops.train_step_flops(setup.model_config, rows, length, length),
              train.count_params(setup.abstract_state.params),
              lambda metrics: float(metrics['nll']) / float(metrics['weight']))


@dataclasses.dataclass
class ReferenceStep:
  """The reference's model config, optimiser and train step for a t2t_jax config."""
  model_config: object  # The reference's models.TransformerConfig (deterministic=False).
  optimizer: optax.GradientTransformation
  step: object  # (state, batch, rng) -> (state, metrics), its 'batch' axis bound (size 1).

  def init_state(self, reference, rng, length: int):
    """A fresh TrainState of the reference (traceable: jax.eval_shape gives the abstract one)."""
    tokens = jnp.ones((1, length), jnp.int32)
    params = reference.models.Transformer(self.model_config.replace(deterministic=True)).init(
        rng, tokens, tokens)['params']
    return reference.train.TrainState.create(apply_fn=None, params=params, tx=self.optimizer,
                                             dynamic_scale=None)


def reference_step(reference, config, shape: common.Shape) -> ReferenceStep:
  """The reference's train_step with the t2t_jax config's optimiser, smoothing and sharing."""
  model, opt = config.model, config.opt
  model_config = reference.models.TransformerConfig(
      vocab_size=shape.vocab, output_vocab_size=shape.vocab,
      share_embeddings=model.share_embeddings, logits_via_embedding=model.tie_output,
      dtype=jnp.dtype(model.dtype), emb_dim=shape.d_model, num_heads=shape.heads,
      num_layers=shape.layers, qkv_dim=shape.d_model, mlp_dim=shape.d_ff, max_len=model.max_len,
      dropout_rate=model.dropout, attention_dropout_rate=model.attention_dropout,
      deterministic=False, decode=False)
  # t2t_jax's rsqrt schedule peaks at lr_scale * d^-0.5 * warmup^-0.5 at the end of warmup.
  peak_rate = opt.lr_scale * shape.d_model**-0.5 * opt.warmup_steps**-0.5
  schedule = reference.train.create_learning_rate_schedule(peak_rate, opt.warmup_steps)
  optimizer = optax.adamw(schedule, b1=opt.b1, b2=opt.b2, eps=opt.eps,
                          weight_decay=opt.weight_decay)

  def step(state, batch, rng):
    return reference.train.train_step(state, batch, model_config, schedule,
                                      opt.label_smoothing, rng)

  # The example runs its step under pmap, whose 'batch' axis its pmean and psum name. A vmap
  # of size 1 over nothing binds that name with no collective in the program, as one device
  # needs none.
  return ReferenceStep(model_config, optimizer, jax.vmap(
      step, in_axes=None, out_axes=None, axis_name='batch', axis_size=1))


def reference_side(reference, config, shape: common.Shape, batch: dict, rows: int,
                   length: int) -> Side:
  """The reference's step (reference_step) compiled for the first device, with its state."""
  setup = reference_step(reference, config, shape)
  model_config = setup.model_config
  state = jax.jit(functools.partial(setup.init_state, reference, length=length))(
      jax.random.PRNGKey(0))
  jitted = jax.jit(setup.step, donate_argnums=0)
  device = jax.devices()[0]
  reference_batch = jax.device_put({_REFERENCE_KEYS[k]: v for k, v in batch.items()}, device)
  rng = jax.random.PRNGKey(1)
  start = time.perf_counter()
  compiled = jitted.lower(state, reference_batch, rng).compile()
  compile_seconds = time.perf_counter() - start
  model_flops = flops.model_flops_per_step(
      d_model=model_config.emb_dim, d_ff=model_config.mlp_dim,
      num_encoder_layers=model_config.num_layers, num_decoder_layers=model_config.num_layers,
      vocab_size=model_config.output_vocab_size, source_tokens=rows * length,
      target_tokens=rows * length, source_length=length, target_length=length)
  return Side('reference', compiled, state, reference_batch, rng, compile_seconds,
              common.xla_flops(compiled), model_flops, train.count_params(state.params),
              lambda metrics: float(metrics['loss']) / float(metrics['denominator']))


def run_rounds(label: str, sides: list[Side], matmul: common.Matmul, args):
  """Per-round median step seconds of each side, and the matmul's FLOP/s of each round."""
  for side in sides:
    side.first_nll = side.nll(side.step())
    for _ in range(args.warmup - 1):
      side.step()
  seconds = {side.name: [] for side in sides}
  matmul_rates = []
  for round_index in range(args.rounds):
    for side in sides if round_index % 2 == 0 else sides[::-1]:
      seconds[side.name].append(common.median_seconds(side.step, args.steps, warmup=0))
    matmul_rates.append(matmul.flops_per_second())
    t2t, reference = seconds['t2t_jax'][-1], seconds['reference'][-1]
    print(f'{label} round {round_index}: t2t_jax {t2t:.4f}s, reference {reference:.4f}s, '
          f'ratio {reference / t2t:.3f}, matmul {matmul_rates[-1] / 1e9:.1f} GFLOP/s',
          file=sys.stderr, flush=True)
  return seconds, matmul_rates


def side_summary(side: Side, seconds: list[float], matmul_rates: list[float], tokens: int,
                 peak: float | None) -> dict:
  median = statistics.median(seconds)
  return {
      'step_seconds': [round(s, 5) for s in seconds],
      'tokens_per_second': round(tokens / median, 1),
      'xla_flops_per_step': side.xla_flops,
      'model_flops_per_step': side.model_flops,
      'model_flops_per_second': side.model_flops / median,
      'share_of_matmul': round(statistics.median(
          side.model_flops / s / m for s, m in zip(seconds, matmul_rates)), 4),
      'mfu': round(flops.mfu(side.model_flops, median, peak), 4) if peak else None,
      'compile_seconds': round(side.compile_seconds, 2),
      'params': side.params,
      'first_nll': round(side.first_nll, 4),
  }


def compare_shape(name: str, args, reference, matmul: common.Matmul) -> dict:
  shape = common.SHAPES[name]
  on_cpu = jax.devices()[0].platform == 'cpu'
  rows = args.rows or (shape.rows if on_cpu else shape.accelerator_rows or shape.rows)
  length = args.length or shape.length
  config = shape_config(shape, args)
  model = config.model  # After --t2t_override: the reference follows its dropout and dtype.
  batch = make_batch(shape, rows, length)
  sides = [t2t_side(config, shape, batch, rows, length),
           reference_side(reference, config, shape, batch, rows, length)]
  seconds, matmul_rates = run_rounds(name, sides, matmul, args)
  ratios = [r / t for t, r in zip(seconds['t2t_jax'], seconds['reference'])]
  peak = flops.peak_flops_per_second(jax.devices()[0].device_kind, model.dtype)
  return {
      'benchmark': 'compare', 'shape': name,
      **{key: value for key, value in dataclasses.asdict(shape).items()
         if key not in ('rows', 'accelerator_rows')},
      'rows': rows, 'length': length, **common.device_info(),
      'device_count': 1,  # Both sides run on the first device alone.
      'dtype': model.dtype, 'norm': model.norm, 'recipe': args.recipe,
      't2t_overrides': args.t2t_override,
      'dropout': {'t2t_jax': {'dropout': model.dropout,
                              'attention_dropout': model.attention_dropout,
                              'relu_dropout': model.relu_dropout},
                  'reference': {'dropout_rate': model.dropout,
                                'attention_dropout_rate': model.attention_dropout,
                                'mlp_hidden_dropout': model.dropout}},
      'rounds': args.rounds, 'steps_per_round': args.steps,
      'ratio_per_round': [round(r, 4) for r in ratios],
      'ratio_median': round(statistics.median(ratios), 4),
      'ratio_min': round(min(ratios), 4), 'ratio_max': round(max(ratios), 4),
      'matmul_flops_per_second': matmul_rates, 'peak_flops_per_second': peak,
      **{side.name: side_summary(side, seconds[side.name], matmul_rates, rows * length, peak)
         for side in sides},
  }


def compare_shapes(args) -> list[dict]:
  """Compares every shape of `args` (the parsed flags); prints and returns one dict per shape."""
  reference = flax_reference.import_reference(args.reference_dir)
  matmul = common.Matmul(2048, jnp.float32)
  results = []
  for name in args.shapes:
    results.append(compare_shape(name, args, reference, matmul))
    print(cli.json_line(results[-1]), flush=True)
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  compare_shapes(flags.FLAGS)


if __name__ == '__main__':
  define_flags()  # Only when run as a command, so importing this module defines no flags.
  cli.run(main, compilation_cache=None)  # Timed compiles stay fresh unless asked.
