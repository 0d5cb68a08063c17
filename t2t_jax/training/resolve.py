"""Every value t2t_jax derives from a config and the devices it runs on, in one step.

A config may leave settings to t2t_jax: `model.dtype` and `eval.dtype` 'auto' (bfloat16 on GPUs
and TPUs, float32 on CPUs), `model.attention_impl` 'auto', one -1 in `mesh.shape` (the devices
left over). `resolve` runs every check of the config (config_check) and then computes each
derived value for the devices given: this process's, or a compile-only target's (a dry run).
Training writes the result into config.json and every checkpoint under "resolved", beside what
was asked; a resume that resolves differently says so in one line, and refuses where the
numerics would change unless the user sets the value (`check_resume`).

Nothing here opens a device that is not asked for: `resolve` takes the devices, and a
preparation step that has none (t2t_jax.prepare) runs config_check without them.
"""

import dataclasses
import json
import math
from typing import Any, Sequence

from absl import logging
import jax
import jax.numpy as jnp

from t2t_jax import ConfigError
from t2t_jax import RESOLVED_KEY
from t2t_jax import as_asked
from t2t_jax import sharding
from t2t_jax.data import batching
from t2t_jax.decoding import translator
from t2t_jax.model.model_config import compute_dtype, resolve_attention_impl
from t2t_jax.training import config_check

# Resolved values whose change changes the numbers a run computes: a resume refuses to change
# them behind the user's back. Keyed by the config key that asks for them.
NUMERIC_KEYS = ('model.dtype', 'model.attention_impl', 'eval.dtype')
# Resolved values that say where a run computes: a resume may change them (one log line).
SHAPE_KEYS = ('devices', 'processes', 'mesh.shape', 'batch_shards')
# Dropout PRNGs whose draws do not depend on how the arrays are split over devices.
PARTITIONABLE_PRNGS = ('hash32', 'threefry2x32')


@dataclasses.dataclass(frozen=True)
class Resolved:
  """What a config asks for, as it runs on `platform`'s devices."""
  platform: str  # 'cpu', 'gpu' or 'tpu'.
  devices: int
  processes: int
  model_dtype: str  # config.model.dtype: the activations' dtype.
  attention_impl: str  # config.model.attention_impl: 'einsum', 'xla', 'cudnn', 'pallas' or 'flash'.
  eval_dtype: str  # config.eval.dtype: what the searches of evaluation and translation run in.
  mesh_shape: tuple[int, ...]  # config.mesh.shape, every axis sized (MESH_AXES).
  batch_shards: int  # Ways a batch splits over the mesh's batch axes.
  # A train batch's rows are a multiple of this (config.data.row_multiple; 0 asks for the batch
  # shards x accumulation of the mesh the run starts on, which a resume keeps).
  train_row_multiple: int

  def as_dict(self) -> dict[str, Any]:
    """As config.json records it: named by the config key each resolves where there is one."""
    return {'platform': self.platform, 'devices': self.devices, 'processes': self.processes,
            'model.dtype': self.model_dtype, 'model.attention_impl': self.attention_impl,
            'eval.dtype': self.eval_dtype, 'mesh.shape': list(self.mesh_shape),
            'batch_shards': self.batch_shards, 'data.row_multiple': self.train_row_multiple}


def resolve(config, devices: Sequence[Any] | None = None) -> Resolved:
  """Checks `config` against `devices` (default: this process's) and resolves it for them.

  Raises ConfigError listing every problem.
  """
  devices = jax.devices() if devices is None else list(devices)
  config_check.check(config, devices=devices)
  platform = devices[0].platform
  model_dtype = compute_dtype(config.model.dtype, platform)
  mesh = sharding.make_mesh(config.mesh, devices)
  return Resolved(
      platform=platform, devices=len(devices),
      processes=len({device.process_index for device in devices}),
      model_dtype=jnp.dtype(model_dtype).name,
      attention_impl=resolve_attention_impl(
          config.model.attention_impl, model_dtype,
          config.model.d_model // config.model.num_heads, config.model.attention_dropout,
          platform),
      eval_dtype=translator.eval_dtype(config.eval.dtype, jnp.dtype(model_dtype).name, platform),
      mesh_shape=tuple(mesh.shape.values()), batch_shards=sharding.batch_shards(mesh),
      train_row_multiple=batching.plan_row_multiple(config, sharding.batch_shards(mesh)))


def config_json(config, resolved: Resolved) -> str:
  """config.json: the config as asked, and under "resolved" what it resolved to."""
  asked = json.loads(config.to_json_best_effort())
  return json.dumps({**asked, RESOLVED_KEY: resolved.as_dict()}, indent=2, sort_keys=True)


def _value(tree: dict, dotted: str):
  for part in dotted.split('.'):
    tree = tree.get(part, {}) if isinstance(tree, dict) else {}
  return tree if tree != {} else None


def _saved_resolved(saved: dict) -> dict:
  """The saved "resolved" section, its keys as named now."""
  before = dict(saved.get(RESOLVED_KEY) or {})
  if 'train_row_multiple' in before:  # Its name when resolved values were first recorded.
    before['data.row_multiple'] = before.pop('train_row_multiple')
  return before


def for_saved_run(config, resolved: Resolved, saved_json: str, where: str) -> Resolved:
  """`resolved` as the run saved at `where` goes on here: with that run's train plan (its row
  multiple), whatever mesh it was saved on.

  Raises ConfigError, one line with the ways on, where this launch's batch shards x
  micro-batches cannot split that plan's batches, or the config asks for another plan.
  """
  multiple = _saved_resolved(json.loads(saved_json)).get('data.row_multiple')
  if multiple is None:  # Saved before it was recorded: the iterator's plan signature decides.
    return resolved
  asked = config.data.row_multiple
  if asked and asked != multiple:
    raise ConfigError(
        f'config.data.row_multiple={asked} asks for other global batches than those of the run '
        f'saved at {where}, whose rows are multiples of {multiple}: leave it at 0 (or set '
        f'{multiple}) to resume, or start a new --workdir')
  rows = batching.train_rows(config.data, multiple)
  problem = batching.split_problem(rows, resolved.batch_shards, config.opt.grad_accum_steps,
                                   resolved.processes)
  if problem:
    raise ConfigError(f'cannot resume the run saved at {where} on this mesh: {problem}. '
                      + _ways_on(math.gcd(*rows), resolved, config, where))
  return dataclasses.replace(resolved, train_row_multiple=multiple)


def _ways_on(whole: int, resolved: Resolved, config, where: str) -> str:
  """Settings near this launch's that split batches whose row counts are multiples of `whole`."""
  shards, accumulation = resolved.batch_shards, config.opt.grad_accum_steps
  processes, devices = resolved.processes, resolved.devices
  fits = lambda s, a: whole % math.lcm(s * a, processes) == 0
  ways = []
  fewer = [a for a in range(accumulation - 1, 0, -1) if fits(shards, a)]
  if fewer:
    ways.append(f'--config.opt.grad_accum_steps={fewer[0]} (more rows per device)')
  expert = resolved.mesh_shape[sharding.MESH_AXES.index('expert')]
  smaller = [s for s in range(shards - 1, 0, -1)
             if devices % s == 0 and s % expert == 0 and fits(s, accumulation)]
  if smaller:
    s = smaller[0]
    ways.append(f'--config.mesh.shape=({s // expert},1,{devices // s},{expert}) ({s} batch '
                f'shards, the other devices on the tensor axis) or {s} devices')
  ways.append(f'a new --workdir with --config.data.row_multiple='
              f'{math.lcm(shards * accumulation, processes)} and --config.ckpt.init_from={where} '
              '(its parameters; a new optimiser state and data order)')
  return 'Ways on: ' + '; or '.join(ways)


def _count(number, noun: str) -> str:
  return f'{number} {noun}' + ('' if number == 1 else 'es' if noun.endswith(('ss', 'ch')) else 's')


def _shape(resolved: dict, accumulation) -> str:
  mesh = ' '.join(f'{axis}={size}' for axis, size in
                  zip(sharding.MESH_AXES, resolved.get('mesh.shape') or ()))
  return (f"{_count(resolved.get('devices'), resolved.get('platform', '') + ' device')} in "
          f"{_count(resolved.get('processes'), 'process')}, mesh {mesh}, "
          f"{_count(accumulation, 'micro-batch')}")


def check_resume(saved_json: str, config, resolved: Resolved, where: str) -> None:
  """Says in one line where the run saved at `where` moved and how this launch resolves
  differently; raises ConfigError where a numeric value would change although the user asked
  for the same setting as then (so the change comes from the devices, not from the user)."""
  saved = json.loads(saved_json)
  before = _saved_resolved(saved)
  if not before:
    return  # Saved before resolved values were recorded: nothing to compare.
  now = resolved.as_dict()
  current = json.loads(config.to_json_best_effort())
  refused, changed = [], []
  for key in sorted(set(before) | set(now)):
    if before.get(key) == now.get(key) or key in SHAPE_KEYS:
      continue
    if key in NUMERIC_KEYS and _value(as_asked(saved), key) == _value(current, key):
      refused.append(
          f'config.{key}={_value(current, key)!r} resolved to {before[key]!r} on '
          f"{before.get('platform')} when {where} was saved and resolves to {now[key]!r} on "
          f'{now["platform"]} here, which changes the numerics: set --config.{key}='
          f'{before[key]} to resume as saved, or --config.{key}={now[key]} to change it')
    else:
      changed.append(f'{key}: {before.get(key)!r} -> {now.get(key)!r}')
  if refused:
    raise ConfigError('; '.join(refused))
  accumulation = (_value(as_asked(saved), 'opt.grad_accum_steps'),
                  config.opt.grad_accum_steps)
  if accumulation[0] != accumulation[1] or any(before.get(k) != now.get(k) for k in SHAPE_KEYS):
    logging.warning('Resuming %s on another shape: %s -> %s%s. %s', where,
                    _shape(before, accumulation[0]), _shape(now, accumulation[1]),
                    f' (and {"; ".join(changed)})' if changed else '',
                    _what_moving_changes(before, accumulation, config))
  elif changed:
    logging.warning('Resuming %s resolved for other devices: %s', where, '; '.join(changed))


def _what_moving_changes(before: dict, accumulation: tuple, config) -> str:
  """What a run moved to another shape computes differently from one that stayed."""
  same_draws = (accumulation[0] == accumulation[1] and
                config.model.dropout_prng in PARTITIONABLE_PRNGS)
  text = (f"The same global batches (rows in multiples of {before.get('data.row_multiple')})"
          f"{' and dropout masks' if same_draws else ''} follow; only the order of "
          'floating-point sums changes (gradients are reduced over other shards), so values '
          'leave those of a run that did not move in the last bits and drift slowly')
  if accumulation[0] != accumulation[1]:
    text += ('; other micro-batches also draw other dropout masks (each micro-batch draws '
             'its own), a change of random numbers, not of data')
  elif config.model.dropout_prng not in PARTITIONABLE_PRNGS:
    text += (f'; config.model.dropout_prng={config.model.dropout_prng!r} draws other dropout '
             'masks on another sharding (hash32 and threefry2x32 do not)')
  return text
