"""Shared measuring helpers for the benchmarks: medians, and a matmul reference in-process."""

import statistics
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
