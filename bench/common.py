"""Shared measuring helpers for the benchmarks: medians, and a matmul reference in-process."""

import collections
import glob
import gzip
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp

from t2t_jax import flops


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
