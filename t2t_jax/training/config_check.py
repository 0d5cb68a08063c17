"""Checks a whole config before any work: every violation names the key and what is allowed.

Choices whose check lives next to the code that uses them (the model's norm, remat, dtype,
attention implementation and pattern, experts, the dropout PRNG, the schedule, the mesh) are
checked by calling that code.
"""

import math
import os

import jax

from t2t_jax import ConfigError
from t2t_jax import sharding
from t2t_jax.data import batching
from t2t_jax.data import pipeline as data
from t2t_jax.data import sources
from t2t_jax.data import tokenizer
from t2t_jax.decoding import translator
from t2t_jax.model import positions
from t2t_jax.model import prng
from t2t_jax.model.model_config import MODEL_KINDS, PREFIX_ATTENTION, PRETRAINING_HEADS
from t2t_jax.model.model_config import TransformerConfig
from t2t_jax.training import fused_loss
from t2t_jax.training import optim
from t2t_jax.training import step

_INF = math.inf
# key: (lowest, highest, whether the lowest itself is allowed). Highest is always allowed.
RANGES = {
    'seed': (0, _INF, True),
    'data.num_symbols': (1, _INF, True),
    'data.min_length': (1, _INF, True),
    'data.max_length': (1, _INF, True),
    'data.num_train': (1, _INF, True),
    'data.num_eval': (0, _INF, True),
    'data.vocab_sample_chars': (1, _INF, True),
    'data.max_len': (1, _INF, True),
    'data.batch_tokens': (1, _INF, True),
    'data.bucket_scale': (1.0, _INF, True),
    'data.min_bucket': (1, _INF, True),
    'data.pack_length': (0, _INF, True),
    'data.row_multiple': (0, _INF, True),
    'model.d_model': (1, _INF, True),
    'model.d_ff': (1, _INF, True),
    'model.num_heads': (1, _INF, True),
    'model.num_encoder_layers': (0, _INF, True),
    'model.num_decoder_layers': (1, _INF, True),
    'model.dropout': (0.0, 1.0, True),
    'model.attention_dropout': (0.0, 1.0, True),
    'model.relu_dropout': (0.0, 1.0, True),
    'model.max_len': (1, _INF, True),
    'model.moe_experts': (0, _INF, True),
    'model.moe_top_k': (1, _INF, True),
    'model.moe_capacity_factor': (-_INF, _INF, True),  # <= 0: no capacity limit.
    'model.moe_aux_loss_weight': (0.0, _INF, True),
    'model.moe_group_size': (0, _INF, True),
    'model.max_relative_distance': (1, _INF, True),
    'model.local_half_width': (1, _INF, True),
    'model.compression_stride': (1, _INF, True),
    'opt.lr_scale': (0.0, _INF, True),  # 0 freezes the weights.
    'opt.warmup_steps': (0, _INF, True),
    'opt.cooldown_steps': (0, _INF, True),
    'opt.final_lr_fraction': (0.0, 1.0, True),
    'opt.b1': (0.0, 1.0, True),
    'opt.b2': (0.0, 1.0, True),
    'opt.eps': (0.0, _INF, True),
    'opt.grad_clip': (0.0, _INF, True),
    'opt.weight_decay': (0.0, _INF, True),
    'opt.label_smoothing': (0.0, 1.0, True),
    'opt.grad_accum_steps': (1, _INF, True),
    'opt.loss_chunk_tokens': (0, _INF, True),
    'opt.ema_decay': (0.0, 1.0, True),  # 0: no moving average.
    'train.num_steps': (1, _INF, True),
    'train.log_every': (1, _INF, True),
    'train.eval_every': (1, _INF, True),
    'train.step_timeout_seconds': (0.0, _INF, True),
    'eval.num_batches': (0, _INF, True),
    'eval.bleu_sentences': (-1, _INF, True),
    'eval.bleu_every': (0, _INF, True),
    'eval.beam_size': (1, _INF, True),
    'eval.alpha': (0.0, _INF, True),
    'eval.max_extra_len': (0, _INF, True),
    'eval.examples_to_print': (0, _INF, True),
    'eval.average_last': (0, _INF, True),
    'ckpt.every': (0, _INF, True),
    'ckpt.keep': (1, _INF, True),
    'ckpt.keep_every': (0, _INF, True),
    'ckpt.preemption_grace_seconds': (0.0, _INF, False),
    'mesh.dcn_data': (1, _INF, True),
    'mesh.collective_combine_bytes': (0, _INF, True),
}
# Dropout rates, Adam's betas and the EMA decay must stay below 1: at 1 nothing is kept, or
# nothing forgotten (the moving average would never move).
_BELOW_ONE = ('model.dropout', 'model.attention_dropout', 'model.relu_dropout', 'opt.b1',
              'opt.b2', 'opt.label_smoothing', 'opt.ema_decay')
CHOICES = {
    'data.source': sources.SOURCES,
    'data.task': data.SYNTHETIC_TASKS,
    'data.bad_lines': sources.BAD_LINE_POLICIES,
    'data.vocab_type': tokenizer.MODEL_TYPES,
    'data.batching': batching.BATCHING_MODES,
    'model.kind': MODEL_KINDS,
    'model.prefix_attention': PREFIX_ATTENTION,
    'eval.dtype': translator.DECODE_DTYPES,
    'eval.length_penalty': translator.LENGTH_PENALTIES,
    'model.positions': positions.POSITION_KINDS,
    'opt.loss_impl': step.LOSS_IMPLS,
}


def _value(config, key: str):
  for part in key.split('.'):
    config = config[part]
  return config


def _range_problem(key: str, value) -> str:
  low, high, low_allowed = RANGES[key]
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return f'config.{key}={value!r} must be a number'
  high_allowed = key not in _BELOW_ONE
  too_low = value < low or (value == low and not low_allowed)
  too_high = value > high or (value == high and not high_allowed)
  if too_low or too_high or math.isnan(value):
    allowed = (f'{"[" if low_allowed else "("}{low}, '
               f'{high if high < _INF else "inf"}{"]" if high_allowed and high < _INF else ")"}')
    return f'config.{key}={value!r} is outside the allowed range {allowed}'
  return ''


def check(config, mesh: bool = True, devices=None) -> None:
  """Raises ConfigError listing every violation in `config`; `mesh`: also against the devices
  (`devices`, a compile-only target's, or this process's)."""
  problems = [problem for key in RANGES if (problem := _range_problem(key, _value(config, key)))]
  problems += [f'config.{key}={_value(config, key)!r} must be one of {choices}'
               for key, choices in CHOICES.items() if _value(config, key) not in choices]
  if config.data.min_length > config.data.max_length:
    problems.append(f'config.data.min_length={config.data.min_length} must not exceed '
                    f'config.data.max_length={config.data.max_length}')
  if config.data.source != 'synthetic' and config.data.vocab_size <= tokenizer.RESERVED_IDS:
    problems.append(f'config.data.vocab_size={config.data.vocab_size} must exceed the '
                    f'{tokenizer.RESERVED_IDS} reserved ids (pad, EOS, unknown)')
  problems += _kind_and_source_problems(config)
  problems += _profile_problems(config.train)
  if config.model.attention_impl == 'cudnn' and config.data.batching == 'packed':
    problems.append("config.model.attention_impl='cudnn' cannot read packed rows "
                    "(config.data.batching='packed'): cuDNN is given sequence lengths, which "
                    "cannot separate the segments of a row. Use data.batching='buckets', or "
                    "attention_impl 'xla' (exact with packed rows), 'einsum' or 'auto'")
  if problems:  # Checks below need the values above to be sane.
    raise ConfigError('; '.join(problems))
  if config.ckpt.keep < config.eval.average_last:
    problems.append(f'config.ckpt.keep={config.ckpt.keep} must be at least '
                    f'config.eval.average_last={config.eval.average_last}, the checkpoints '
                    'averaged at each evaluation')
  if mesh and devices is None:
    devices = jax.devices()
  platform = devices[0].platform if devices else None  # None: checks that need one wait.
  problems += _loss_problems(config, platform)
  for call in (lambda: TransformerConfig.from_config(config.model, data.vocab_size(config),
                                                     platform=platform),
               lambda: prng.impl(config.model.dropout_prng),
               lambda: optim.learning_rate_schedule(config.opt, config.model.d_model,
                                                    config.train.num_steps),
               lambda: mesh and sharding.make_mesh(config.mesh, devices)):
    try:
      call()
    except ConfigError as e:
      problems.append(str(e))
  if not problems and mesh:
    problems += _batch_problems(config, devices)
  if problems:
    raise ConfigError('; '.join(problems))


def _batch_problems(config, devices=None) -> list[str]:
  """The token budget must give every data shard of the mesh (and micro-batch) a row of the
  shortest batch length (the packed row, or the smallest bucket); a longer bucket it cannot
  fill that way gets one row per shard (batching.py), more tokens than the budget."""
  mesh = sharding.make_mesh(config.mesh, devices)
  shards = sharding.batch_shards(mesh)
  parts = shards * config.opt.grad_accum_steps
  if config.data.row_multiple:  # A plan of its own: the mesh must split it.
    processes = len({device.process_index for device in mesh.devices.flat})
    problem = batching.split_problem(
        batching.train_rows(config.data, config.data.row_multiple), shards,
        config.opt.grad_accum_steps, processes)
    return [f'config.data.row_multiple={config.data.row_multiple}: {problem}; use a multiple '
            f'of {math.lcm(parts, processes)}'] if problem else []
  if config.data.batching == 'packed':
    length, what = batching.pack_length(config.data), 'the packed row'
  else:
    length = min(config.data.min_bucket, config.model.max_len)
    what = 'the shortest bucket, config.data.min_bucket'
  if config.data.batch_tokens // length >= parts:
    return []
  accumulation = (f' x config.opt.grad_accum_steps={config.opt.grad_accum_steps}'
                  if config.opt.grad_accum_steps > 1 else '')
  return [f'config.data.batch_tokens={config.data.batch_tokens} gives '
          f'{config.data.batch_tokens // length} rows of {length} tokens ({what}), fewer than '
          f'the {shards} data shards of the mesh (config.mesh.shape={tuple(config.mesh.shape)})'
          f'{accumulation}: raise config.data.batch_tokens to at least {parts * length}, or '
          'put fewer devices on the batch axes of config.mesh']


def _profile_problems(train) -> list[str]:
  """config.train.profile_steps: () for no profile, or (first, last), steps of the run."""
  steps = tuple(train.profile_steps or ())
  if not steps:
    return []
  if not (len(steps) == 2 and all(isinstance(s, int) and not isinstance(s, bool) for s in steps)
          and 1 <= steps[0] <= steps[1]):
    return [f'config.train.profile_steps={steps!r} must be (first, last), two whole steps with '
            '1 <= first <= last, e.g. --config.train.profile_steps="(10, 12)", or () for no '
            'profile']
  if steps[1] > train.num_steps:
    return [f'config.train.profile_steps={steps!r} ends after config.train.num_steps='
            f'{train.num_steps}, the last step the run trains: end the window by then']
  return []


def _loss_problems(config, platform: str | None) -> list[str]:
  """What the fused loss kernels (fused_loss.py) cannot run: a TPU, an encoder-only model's
  heads (their losses are not over the token vocabulary), an unsupported hidden width."""
  if config.opt.loss_impl != 'fused':
    return []
  problems = []
  if platform == 'tpu':
    problems.append("config.opt.loss_impl='fused' runs Triton (GPU) kernels, which a TPU "
                    "cannot: use loss_impl='xla' (with opt.loss_chunk_tokens) on a TPU")
  if config.model.kind == 'encoder_only':
    problems.append("config.opt.loss_impl='fused' computes the token loss of translation and "
                    "language models; an encoder-only model's heads need loss_impl='xla'")
  if not fused_loss.supported_width(config.model.d_model):
    problems.append(f"config.opt.loss_impl='fused' needs config.model.d_model (got "
                    f"{config.model.d_model}) a multiple of 16: use loss_impl='xla'")
  return problems


def _kind_and_source_problems(config) -> list[str]:
  """Which kinds of model each source trains (language modelling the decoder-only model,
  masked-LM pre-training and labelled text the encoder-only one), and what they need."""
  problems = []
  kind, head, source = config.model.kind, config.model.head, config.data.source
  if source == 'lm':
    if kind == 'encoder_decoder':
      problems.append(f"config.data.source='lm' needs config.model.kind='decoder_only' (a "
                      "language model) or 'encoder_only' (masked-LM pre-training), got "
                      f'{kind!r}: text alone has no source to encode')
    elif kind == 'encoder_only' and head not in PRETRAINING_HEADS:
      problems.append(f"config.data.source='lm' (text without labels) pre-trains an "
                      f"encoder-only model's head 'mlm' or 'electra', and config.model.head="
                      f"{head!r}: set one of those, or data.source='labelled' with labelled TSV "
                      "files")
    if config.eval.bleu_sentences:
      problems.append(f'config.eval.bleu_sentences={config.eval.bleu_sentences} must be 0 '
                      "with config.data.source='lm': there are no translations to score (the "
                      'eval figures are loss and perplexity)')
  vocab_path = os.path.expanduser(config.data.vocab_path)
  if config.ckpt.init_from and vocab_path and not os.path.exists(vocab_path):
    problems.append(f'config.data.vocab_path={config.data.vocab_path} does not exist, and a run '
                    f'starting from config.ckpt.init_from={config.ckpt.init_from} must read '
                    "that run's vocabulary, not train a new one: point vocab_path at it")
  if source == 'labelled' and (kind != 'encoder_only' or head in PRETRAINING_HEADS):
    problems.append(f"config.data.source='labelled' trains a classifier or regressor: it needs "
                    f"config.model.kind='encoder_only' (got {kind!r}) and config.model.head "
                    f"'classification' or 'regression' (got {head!r})")
  if not 0.0 <= config.data.holdout < 1.0 or config.data.train_limit < 0:
    problems.append(f'config.data.holdout={config.data.holdout} must be in [0, 1) and '
                    f'config.data.train_limit={config.data.train_limit} at least 0')
  if source == 'labelled' and config.data.batching != 'buckets':
    problems.append("config.data.source='labelled' reads one example per row: set "
                    f"config.data.batching='buckets' (got {config.data.batching!r})")
  if kind == 'encoder_only' and source not in ('lm', 'labelled'):
    problems.append(f"config.model.kind='encoder_only' trains on text (data.source='lm', "
                    f"masked LM) or labelled text (data.source='labelled'), got {source!r}")
  if source == 'labelled' and config.eval.bleu_sentences:
    problems.append(f'config.eval.bleu_sentences={config.eval.bleu_sentences} must be 0 '
                    "with config.data.source='labelled': a classifier translates nothing")
  if kind == 'encoder_only' and config.data.max_len > config.model.max_len:
    problems.append(f'config.data.max_len={config.data.max_len} exceeds config.model.max_len='
                    f'{config.model.max_len}, the positions the encoder covers: raise '
                    'model.max_len or lower data.max_len')
  if kind == 'encoder_only' and source == 'labelled':
    metrics = ('pearson', 'spearman') if head == 'regression' else ('accuracy', 'macro_f1',
                                                                    'mcc')
    if config.eval.best_metric not in metrics:
      problems.append(f'config.eval.best_metric={config.eval.best_metric!r} must be one of '
                      f'{metrics} for a {head} head')
  if config.model.kind == 'decoder_only' and config.data.max_len > config.model.max_len:
    problems.append(f'config.data.max_len={config.data.max_len} exceeds config.model.max_len='
                    f'{config.model.max_len}: a decoder-only model reads source and target as '
                    'one sequence of up to data.max_len positions, so raise model.max_len or '
                    'lower data.max_len')
  return problems
