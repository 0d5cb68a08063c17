"""Training metrics between log lines: per-step sums, the log line, TensorBoard scalars, the
run's final speed figures, and the analytic model FLOPs they are measured against."""

import collections
import contextlib
import gc
import math
import os
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from t2t_jax import NonFiniteLoss
from t2t_jax.model import flops
from t2t_jax.model.model_config import TransformerConfig
from t2t_jax.training import optim


class MetricLog:
  """Accumulates per-step metric sums between logs, checks them, and writes one log line.

  Beside loss and speed it reports model FLOP/s (the analytic count of `flops`, padding
  included) and, where the devices' peak is known (not on CPU), MFU against that peak.

  And where the host's time went between two lines, to tell a slow stretch's cause: the
  shares of the interval spent waiting for input batches (`waiting('input')`), for the device
  (`add` reads a step's metrics, which blocks until that step is done) and saving and
  evaluating (`waiting('save_and_evaluation')`, which the steps/s include),
  the seconds in Python's garbage collector and its collections of the oldest generation,
  and the process's resident memory: the log line's tail, and `write`'s `host_*` figures
  (not TensorBoard scalars: more events per line made a run that fills its disk hang at
  exit, in tensorboardX's queue). Call `close()` to stop timing the collector.
  """

  def __init__(self, writer, schedule, num_steps: int, start_step: int,
               peak_flops_per_second: float | None):
    self.writer, self.schedule, self.num_steps = writer, schedule, num_steps
    self.peak = peak_flops_per_second  # All devices of the mesh together; None if unknown.
    self.sums, self.steps, self.model_flops, self.start = None, 0, 0.0, time.perf_counter()
    self.last_good_step = start_step
    self.last_loss, self.intervals = None, []  # (steps, seconds, model FLOPs) each.
    # Host timings use their own clock (time.monotonic), apart from the interval's.
    self.waits, self._gc_started = collections.Counter(), None
    gc.callbacks.append(self._time_gc)

  @contextlib.contextmanager
  def waiting(self, kind: str):
    """Counts the time inside the block as the host's waiting for `kind`."""
    started = time.monotonic()
    try:
      yield
    finally:
      self.waits[kind] += time.monotonic() - started

  def _time_gc(self, phase: str, info: dict) -> None:
    if phase == 'start':
      self._gc_started = time.monotonic()
    elif self._gc_started is not None:
      self.waits['gc'] += time.monotonic() - self._gc_started
      self.waits['gc_oldest'] += info.get('generation') == 2
      self._gc_started = None

  def close(self) -> None:
    if self._time_gc in gc.callbacks:
      gc.callbacks.remove(self._time_gc)

  def _host_figures(self, elapsed: float) -> dict[str, float]:
    figures = {f'host_{kind}_wait_share': self.waits[kind] / elapsed
               for kind in ('input', 'device', 'save_and_evaluation')}
    figures.update(host_gc_seconds=self.waits['gc'],
                   host_gc_oldest_collections=self.waits['gc_oldest'])
    rss = resident_bytes()
    if rss is not None:
      figures['host_resident_gib'] = rss / 2**30
    self.waits.clear()
    return figures

  def add(self, step: int, metrics, model_flops: float) -> None:
    with self.waiting('device'):  # Blocks until the step that made `metrics` is done.
      metrics = jax.device_get(metrics)
    loss = float(metrics['loss']) / max(float(metrics['weight']), 1.0)
    if not math.isfinite(loss):
      raise NonFiniteLoss(
          f'training loss is {loss} at step {step}; stopping. Parameters after step '
          f'{self.last_good_step} were finite and the last checkpoint is intact: lower '
          'config.opt.lr_scale or set config.opt.grad_clip, then rerun to resume.')
    self.last_good_step = step
    self.sums = metrics if self.sums is None else jax.tree.map(np.add, self.sums, metrics)
    self.steps += 1
    self.model_flops += model_flops

  def write(self, step: int) -> dict[str, float] | None:
    """Logs the figures of the steps since the last line; returns them (None if no step)."""
    if not self.steps:
      return None
    elapsed = time.perf_counter() - self.start
    summary = optim.summarize(self.sums)
    steps_per_second = self.steps / elapsed
    summary.update(learning_rate=float(self.schedule(step - 1)),
                   target_tokens_per_second=float(self.sums['weight']) / elapsed,
                   steps_per_second=steps_per_second,
                   model_flops_per_second=self.model_flops / elapsed)
    if self.peak:
      summary['mfu'] = flops.mfu(self.model_flops, elapsed, self.peak)
    summary.update(self._host_figures(elapsed))
    eta = (self.num_steps - step) / steps_per_second
    experts = (f', MoE aux loss {summary["moe_aux_loss"]:.4f}, dropped '
               f'{summary["moe_dropped_fraction"]:.2%}' if 'moe_aux_loss' in summary else '')
    memory = (f', {summary["host_resident_gib"]:.2f} GiB resident'
              if 'host_resident_gib' in summary else '')
    logging.info('step %d: loss %.4f%s, accuracy %.4f, lr %.3g, %.0f target tokens/s, '
                 '%.2f steps/s, %.4g model TFLOP/s%s, ETA %s; host: input wait %.1f%%, '
                 'device wait %.1f%%, saving/evaluating %.1f%%, gc %.2f s%s', step,
                 summary['loss'], experts,
                 summary['accuracy'], summary['learning_rate'],
                 summary['target_tokens_per_second'], steps_per_second,
                 summary['model_flops_per_second'] / 1e12,
                 f', MFU {summary["mfu"]:.1%}' if self.peak else '',
                 time.strftime('%H:%M:%S', time.gmtime(eta)),
                 100 * summary['host_input_wait_share'], 100 * summary['host_device_wait_share'],
                 100 * summary['host_save_and_evaluation_wait_share'], summary['host_gc_seconds'],
                 memory)
    for name, value in summary.items():
      if not name.startswith('host_'):  # The host figures go to the log line only.
        self.writer.add_scalar(f'train/{name}', value, step)
    self.last_loss = summary['loss']
    self.intervals.append((self.steps, elapsed, self.model_flops))
    self.sums, self.steps, self.model_flops, self.start = None, 0, 0.0, time.perf_counter()
    return summary

  def final(self) -> dict[str, Any]:
    """Last logged loss, steps/s, model FLOP/s and MFU, compiling left out; None says why."""
    if not self.intervals:
      return {'train_loss': None, 'steps_per_second': None, 'model_flops_per_second': None,
              'mfu': None, 'null_reasons': {
                  name: 'no training step ran in this launch' for name in
                  ('train_loss', 'steps_per_second', 'model_flops_per_second', 'mfu')}}
    intervals = self.intervals[1:] or self.intervals
    steps, seconds, model_flops = (sum(column) for column in zip(*intervals))
    seconds = max(seconds, 1e-9)
    figures = {'train_loss': self.last_loss, 'steps_per_second': steps / seconds,
               'model_flops_per_second': model_flops / seconds,
               'mfu': flops.mfu(model_flops, seconds, self.peak) if self.peak else None}
    if not self.peak:
      figures['null_reasons'] = {'mfu': 'the peak FLOP/s of this device kind is not known'}
    return figures


def resident_bytes() -> int | None:
  """This process's resident memory, from /proc (None where there is no /proc)."""
  try:
    with open('/proc/self/statm') as f:
      return int(f.read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
  except (OSError, ValueError, IndexError):
    return None


def step_flops(model_config: TransformerConfig, host_batch: dict) -> float:
  """Analytic FLOPs of the step on this batch: every process's rows at the padded lengths."""
  rows, source_length = host_batch['inputs'].shape
  return flops.train_step_flops(model_config, rows * jax.process_count(), source_length,
                                host_batch['targets'].shape[1])


class NullWriter:
  """Stands for the TensorBoard writer on processes other than 0, which write no events."""

  def add_scalar(self, *args, **kwargs):
    pass

  def close(self):
    pass
