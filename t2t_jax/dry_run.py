"""The dry run: compile the train step for the configured mesh without data, and report its
memory per device and its FLOPs, so a run that cannot fit fails in seconds."""

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp

from t2t_jax import config_check
from t2t_jax import data
from t2t_jax import prng
from t2t_jax import setup as setup_lib
from t2t_jax import sharding


def dry_run(config) -> dict:
  """Compiles the train step for the configured mesh without data; returns size and cost."""
  config_check.check(config)
  setup = setup_lib.build(config, data.vocab_size(config))
  batch, rows, length = abstract_batch(config, setup.mesh)
  rng = jax.ShapeDtypeStruct(prng.dropout_key(jnp.zeros((2,), jnp.uint32),
                                              config.model.dropout_prng).shape, jnp.uint32)
  start = time.perf_counter()
  compiled = setup.train_step.lower(setup.abstract_state, batch, rng).compile()
  compile_seconds = time.perf_counter() - start
  flops = global_flops(setup, config, batch, rng)
  per_device = _memory_per_device(compiled)
  return {
      'config': config.name,
      'params': setup_lib.count_params(setup.abstract_state.params),
      'flops_per_step': flops,
      'flops_per_step_per_device': flops / setup.mesh.size,
      'batch_shape': [rows, length],
      'grad_accum_steps': config.opt.grad_accum_steps,
      'scan_layers': config.model.scan_layers,
      'remat': config.model.remat,
      'attention_pattern': config.model.attention_pattern,
      'positions': config.model.positions,
      'dtype': jnp.dtype(setup.model_config.dtype).name,
      'mesh': dict(setup.mesh.shape),
      'device_count': setup.mesh.size,
      'device_kind': jax.devices()[0].device_kind,
      'memory_per_device_bytes': per_device,
      'compile_seconds': round(compile_seconds, 2),
      **_device_fit(per_device['total']),
  }


def abstract_batch(config, mesh) -> tuple[dict, int, int]:
  """The global batch the config trains on, as sharded ShapeDtypeStructs; its rows and length.

  The longest bucket (or the packed row length), with as many rows as the token budget
  allows, rounded down to whole rows per batch shard and micro-batch.
  """
  shards = sharding.batch_shards(mesh) * config.opt.grad_accum_steps
  if config.data.batching == 'packed':
    length = data.pack_length(config.data)
    keys = ('inputs', 'targets', 'inputs_positions', 'targets_positions', 'inputs_segments',
            'targets_segments')
  else:
    length = min(data.bucket_boundaries(config.data.max_len, config.data.min_bucket,
                                        config.data.bucket_scale)[-1], config.model.max_len)
    keys = ('inputs', 'targets')
  rows = max(shards, config.data.batch_tokens // length // shards * shards)
  source_length = 0 if config.data.source == 'lm' else length  # A language model: no source.
  batch = {key: jax.ShapeDtypeStruct((rows, source_length if key.startswith('inputs') else length),
                                     jnp.int32, sharding=sharding.batch_sharding(mesh))
           for key in keys}
  return batch, rows, length


def global_flops(setup: setup_lib.Setup, config, batch, rng) -> float:
  """FLOPs of one whole update, from XLA's cost analysis of the program before partitioning.

  Counted without accumulation, loss chunks or scanned layers: the analysis counts a loop body
  once, and A micro-batches (or U chunks) do the arithmetic of one batch of A times their rows
  (U chunks), as a scan over N layers does that of N layers. Recomputation asked for by
  config.model.remat counts.
  """
  model_config = dataclasses.replace(setup.model_config, scan_layers=False)
  train_step = jax.jit(setup_lib.train_step_of(config, model_config, setup.optimizer,
                                               grad_accum_steps=1, loss_chunk_tokens=0))
  state = setup.abstract_state
  if setup.model_config.scan_layers:
    state, _ = setup_lib.abstract_tree(functools.partial(
        setup_lib.init_state, model_config=model_config, optimizer=setup.optimizer),
                                       setup.mesh, setup.axis_rules)
  with sharding.mesh_context(setup.mesh, setup.axis_rules):
    cost = train_step.lower(state, batch, rng).cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost.get('flops', 0.0))


def _memory_per_device(compiled) -> dict[str, int]:
  """XLA's memory analysis of the compiled step, with the donated state counted once."""
  memory = compiled.memory_analysis()
  per_device = {name: int(getattr(memory, f'{name}_size_in_bytes', 0))
                for name in ('argument', 'output', 'temp', 'alias', 'generated_code')}
  # Donated state is both argument and output: count it once.
  per_device['total'] = (per_device['argument'] + per_device['output'] + per_device['temp']
                         - per_device['alias'])
  return per_device


def _device_fit(total_bytes: int) -> dict:
  """On an accelerator that reports its memory, whether the step fits in it."""
  limit = (jax.devices()[0].memory_stats() or {}).get('bytes_limit')
  return {'device_memory_bytes': int(limit), 'fits': total_bytes <= limit} if limit else {}
