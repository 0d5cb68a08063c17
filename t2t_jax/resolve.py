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
from typing import Any, Sequence

from absl import logging
import jax
import jax.numpy as jnp

from t2t_jax import ConfigError
from t2t_jax import RESOLVED_KEY
from t2t_jax import as_asked
from t2t_jax import config_check
from t2t_jax import sharding
from t2t_jax import translator
from t2t_jax.model_config import compute_dtype, resolve_attention_impl

# Resolved values whose change changes the numbers a run computes: a resume refuses to change
# them behind the user's back. Keyed by the config key that asks for them.
NUMERIC_KEYS = ('model.dtype', 'model.attention_impl', 'eval.dtype')


@dataclasses.dataclass(frozen=True)
class Resolved:
  """What a config asks for, as it runs on `platform`'s devices."""
  platform: str  # 'cpu', 'gpu' or 'tpu'.
  devices: int
  processes: int
  model_dtype: str  # config.model.dtype: the activations' dtype.
  attention_impl: str  # config.model.attention_impl: 'einsum', 'xla', 'cudnn' or 'pallas'.
  eval_dtype: str  # config.eval.dtype: what the searches of evaluation and translation run in.
  mesh_shape: tuple[int, ...]  # config.mesh.shape, every axis sized (MESH_AXES).
  batch_shards: int  # Ways a batch splits over the mesh's batch axes.
  train_row_multiple: int  # A train batch's rows are a multiple of this: shards x accumulation.

  def as_dict(self) -> dict[str, Any]:
    """As config.json records it: named by the config key each resolves where there is one."""
    return {'platform': self.platform, 'devices': self.devices, 'processes': self.processes,
            'model.dtype': self.model_dtype, 'model.attention_impl': self.attention_impl,
            'eval.dtype': self.eval_dtype, 'mesh.shape': list(self.mesh_shape),
            'batch_shards': self.batch_shards, 'train_row_multiple': self.train_row_multiple}


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
      train_row_multiple=sharding.batch_shards(mesh) * config.opt.grad_accum_steps)


def config_json(config, resolved: Resolved) -> str:
  """config.json: the config as asked, and under "resolved" what it resolved to."""
  asked = json.loads(config.to_json_best_effort())
  return json.dumps({**asked, RESOLVED_KEY: resolved.as_dict()}, indent=2, sort_keys=True)


def _value(tree: dict, dotted: str):
  for part in dotted.split('.'):
    tree = tree.get(part, {}) if isinstance(tree, dict) else {}
  return tree if tree != {} else None


def check_resume(saved_json: str, config, resolved: Resolved, where: str) -> None:
  """Says in one line how this launch resolves differently from the one that saved `where`;
  raises ConfigError where a numeric value would change although the user asked for the same
  setting as then (so the change comes from the devices, not from the user)."""
  saved = json.loads(saved_json)
  before = saved.get(RESOLVED_KEY)
  if not before:
    return  # Saved before resolved values were recorded: nothing to compare.
  now = resolved.as_dict()
  current = json.loads(config.to_json_best_effort())
  refused, changed = [], []
  for key in sorted(set(before) | set(now)):
    if before.get(key) == now.get(key):
      continue
    change = f'{key}: {before.get(key)!r} -> {now.get(key)!r}'
    if key in NUMERIC_KEYS and _value(as_asked(saved), key) == _value(current, key):
      refused.append(
          f'config.{key}={_value(current, key)!r} resolved to {before[key]!r} on '
          f"{before.get('platform')} when {where} was saved and resolves to {now[key]!r} on "
          f'{now["platform"]} here, which changes the numerics: set --config.{key}='
          f'{before[key]} to resume as saved, or --config.{key}={now[key]} to change it')
    else:
      changed.append(change)
  if refused:
    raise ConfigError('; '.join(refused))
  if changed:
    logging.warning('Resuming %s resolved for other devices: %s', where, '; '.join(changed))
