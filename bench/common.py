"""What the benchmarks share: model shapes and their t2t_jax configs, medians and spreads, a matmul
yardstick in-process, XLA's FLOP count and op profiles. Imports no other bench module."""

import ast
import collections
import dataclasses
import glob
import gzip
import json
import os
import statistics
import tempfile
import time

from absl import flags
import jax
import jax.numpy as jnp

from configs import base as base_config
from configs import multi30k
from t2t_jax.model import flops


@dataclasses.dataclass(frozen=True)
class Shape:
  """Model dims and the batch: `rows` x `length` tokens on each side."""
  vocab: int
  d_model: int
  d_ff: int
  layers: int  # Encoder and decoder each.
  heads: int
  rows: int
  length: int
  packed_segments: int = 0  # Sentences packed into each row; 0: one per row.
  accelerator_rows: int = 0  # Rows off CPU, where the CPU's batch would leave a chip idle.


SHAPES = {
    'small': Shape(8000, 256, 1024, 3, 4, 64, 64),
    'm30k': Shape(10000, 128, 256, 4, 4, 256, 20),
    'm30k_packed': Shape(10000, 128, 256, 4, 4, 32, 64, packed_segments=4),  # As multi30k.py.
    'base': Shape(32000, 512, 2048, 6, 8, 8, 64),
    'big': Shape(32000, 1024, 4096, 6, 16, 8, 64, accelerator_rows=64),
    'tiny': Shape(128, 32, 64, 1, 2, 4, 16),  # Tests and smoke runs.
    'tiny_packed': Shape(128, 32, 64, 1, 2, 4, 16, packed_segments=3),
}


def dropout_settings(recipe: str, dropout: float, attention_dropout: float,
                     relu_dropout: float) -> dict:
  """t2t_jax's three dropout rates: the ones given, or configs/multi30k.py's for recipe 'm30k'."""
  if recipe == 'm30k':
    model = multi30k.get_config().model
    return dict(dropout=model.dropout, attention_dropout=model.attention_dropout,
                relu_dropout=model.relu_dropout)
  return dict(dropout=dropout, attention_dropout=attention_dropout, relu_dropout=relu_dropout)


def apply_override(config, override: str) -> None:
  """Sets `key=value` (a Python literal, else a string) on an existing config key."""
  key, sep, text = override.partition('=')
  *parents, leaf = key.split('.')
  node = config
  for part in parents:
    node = node[part] if part in node else None
    if node is None:
      break
  if not sep or node is None or leaf not in node:
    raise ValueError(f'--t2t_override {override!r}: needs KEY=VALUE with a key of '
                     'configs/base.py, e.g. model.norm=post')
  try:
    value = ast.literal_eval(text)
  except (ValueError, SyntaxError):
    value = text  # A bare word such as post.
  node[leaf] = value


def t2t_config(shape: Shape, dropout: dict, norm: str = 'pre', dtype: str = 'float32',
               overrides=()):
  """configs/base.py with `shape`'s dims and `dropout`'s rates on a 1x1x1 mesh, then
  `overrides` ('key=value'). The defaults are bench/compare.py's flags' defaults."""
  config = base_config.get_config()
  model = config.model
  model.d_model, model.d_ff, model.num_heads = shape.d_model, shape.d_ff, shape.heads
  model.num_encoder_layers = model.num_decoder_layers = shape.layers
  model.dropout, model.attention_dropout = dropout['dropout'], dropout['attention_dropout']
  model.relu_dropout = dropout['relu_dropout']
  model.norm, model.dtype = norm, dtype
  config.mesh.shape = (1, 1, 1)
  for override in overrides:
    apply_override(config, override)
  return config


def median_seconds(fn, repeats: int, warmup: int = 2) -> float:
  """Median wall time of `fn()` (which must block until its work is done)."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def spread(values) -> dict:
  """Mean, sample standard deviation (0 for one value), minimum and maximum: a setting's seeds."""
  values = list(values)
  return {'mean': statistics.fmean(values),
          'std': statistics.stdev(values) if len(values) > 1 else 0.0,
          'min': min(values), 'max': max(values)}


class Matmul:
  """A square matmul compiled once, timed whenever the yardstick is wanted (each round)."""

  def __init__(self, size: int = 2048, dtype=jnp.float32):
    self.a = jax.random.normal(jax.random.PRNGKey(0), (size, size), dtype)
    self.b = jax.random.normal(jax.random.PRNGKey(1), (size, size), dtype)
    self.matmul = jax.jit(jnp.matmul).lower(self.a, self.b).compile()
    self.flops = 2 * size**3

  def flops_per_second(self, repeats: int = 5, warmup: int = 1) -> float:
    return self.flops / median_seconds(lambda: self.matmul(self.a, self.b).block_until_ready(),
                                       repeats, warmup)


def matmul_flops_per_second(size: int = 1024, dtype=jnp.float32, repeats: int = 10) -> float:
  """This machine's achieved FLOP/s on a square matmul, the yardstick for the other figures."""
  return Matmul(size, dtype).flops_per_second(repeats, warmup=2)


def xla_flops(compiled) -> float:
  """FLOPs of a compiled or lowered computation by XLA's cost analysis (every op counted)."""
  cost = compiled.cost_analysis()
  return float((cost[0] if isinstance(cost, (list, tuple)) else cost)['flops'])


def mfu(model_flops_per_second: float, dtype, devices=None) -> float | None:
  """Model FLOP/s over the published peak of `devices` (default: all); None where unknown."""
  peak = flops.devices_peak_flops_per_second(devices or jax.devices(), dtype)
  return model_flops_per_second / peak if peak else None


def device_info() -> dict:
  return {'device_kind': jax.devices()[0].device_kind, 'device_count': jax.device_count(),
          'platform': jax.devices()[0].platform}


# XLA:CPU/GPU ops that are matrix products: library fusions (YNNPACK, XNNPACK, oneDNN), plain
# dots, and GPU GEMM custom calls. Anything else counts as "other ops".
_MATMUL_KINDS = ('ynn_fusion', 'xnn_fusion', 'onednn', 'dot', 'gemm', 'cublas', 'triton_gemm')


def op_profile(fn) -> dict:
  """One traced call of `fn()` (blocking): its wall seconds and the seconds its XLA ops took,
  split into matrix products and other ops, with the five costliest op kinds.

  Op kinds are the op names up to their first '.' (`ynn_fusion.40` is a `ynn_fusion`); the
  runtime's own events (executors, thread pools, Python frames) and control flow (a while
  loop's event spans its body's ops) are left out. Ops may run concurrently on several
  threads, so op seconds can exceed wall seconds.
  """
  with tempfile.TemporaryDirectory(prefix='t2t_profile_') as directory:
    start = time.perf_counter()
    with jax.profiler.trace(directory):
      fn()
    wall = time.perf_counter() - start
    traces = glob.glob(os.path.join(directory, '**', '*.trace.json.gz'), recursive=True)
    if not traces:
      return {'wall_seconds': round(wall, 4), 'op_seconds': None,
              'null_reason': 'the profiler wrote no trace.json.gz here'}
    with gzip.open(traces[0]) as f:
      events = json.load(f)['traceEvents']
  kinds = collections.Counter()
  for event in events:
    name = event.get('name', '')
    if event.get('ph') != 'X' or not name or name[0] == '$' or name.startswith('end:') or any(
        word in name for word in ('Thunk', 'Pjrt', 'Pjit', 'Slinky', 'ThreadPool', 'Execute')) or (
        name.split('.')[0] in ('while', 'conditional', 'call')):  # Containers: their ops count.
      continue
    kinds[name.split('.')[0]] += event['dur'] / 1e6
  matmul = sum(v for k, v in kinds.items() if k.startswith(_MATMUL_KINDS))
  return {'wall_seconds': round(wall, 4), 'op_seconds': round(sum(kinds.values()), 4),
          'matmul_op_seconds': round(matmul, 4),
          'matmul_share_of_wall': round(matmul / wall, 3),
          'top_op_kinds': {k: round(v, 4) for k, v in kinds.most_common(5)}}


def own_flags(define_flags, program: str, argv: list[str]) -> flags.FlagValues:
  """`argv` (flags only) parsed by the flags `define_flags(flag_values)` defines, into flag
  values of their own: absl's global ones stay untouched."""
  flag_values = flags.FlagValues()
  define_flags(flag_values)
  flag_values([program, *argv])
  return flag_values
