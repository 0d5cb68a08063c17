"""Shared measuring helpers for the benchmarks: medians, and a matmul reference in-process."""

import statistics
import time

import jax
import jax.numpy as jnp


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


def matmul_flops_per_second(size: int = 1024, dtype=jnp.float32, repeats: int = 10) -> float:
  """This machine's achieved FLOP/s on a square matmul, the yardstick for the other figures."""
  a = jax.random.normal(jax.random.PRNGKey(0), (size, size), dtype)
  b = jax.random.normal(jax.random.PRNGKey(1), (size, size), dtype)
  matmul = jax.jit(lambda a, b: a @ b)
  seconds = median_seconds(lambda: matmul(a, b).block_until_ready(), repeats)
  return 2 * size**3 / seconds


def device_info() -> dict:
  return {'device_kind': jax.devices()[0].device_kind, 'device_count': jax.device_count(),
          'platform': jax.devices()[0].platform}
