"""Training metrics between log lines: per-step sums, the log line, TensorBoard scalars, the
run's final speed figures, and the analytic model FLOPs they are measured against."""

import math
import time
from typing import Any

from absl import logging
import jax
import numpy as np

from t2t_jax import NonFiniteLoss
from t2t_jax import flops
from t2t_jax import optim
from t2t_jax.model_config import TransformerConfig


class MetricLog:
  """Accumulates per-step metric sums between logs, checks them, and writes one log line.

  Beside loss and speed it reports model FLOP/s (the analytic count of `flops`, padding
  included) and, where the devices' peak is known (not on CPU), MFU against that peak.
  """

  def __init__(self, writer, schedule, num_steps: int, start_step: int,
               peak_flops_per_second: float | None):
    self.writer, self.schedule, self.num_steps = writer, schedule, num_steps
    self.peak = peak_flops_per_second  # All devices of the mesh together; None if unknown.
    self.sums, self.steps, self.model_flops, self.start = None, 0, 0.0, time.perf_counter()
    self.last_good_step = start_step
    self.last_loss, self.intervals = None, []  # (steps, seconds, model FLOPs) each.

  def add(self, step: int, metrics, model_flops: float) -> None:
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

  def write(self, step: int) -> None:
    if not self.steps:
      return
    elapsed = time.perf_counter() - self.start
    summary = optim.summarize(self.sums)
    steps_per_second = self.steps / elapsed
    summary.update(learning_rate=float(self.schedule(step - 1)),
                   target_tokens_per_second=float(self.sums['weight']) / elapsed,
                   steps_per_second=steps_per_second,
                   model_flops_per_second=self.model_flops / elapsed)
    if self.peak:
      summary['mfu'] = flops.mfu(self.model_flops, elapsed, self.peak)
    eta = (self.num_steps - step) / steps_per_second
    experts = (f', MoE aux loss {summary["moe_aux_loss"]:.4f}, dropped '
               f'{summary["moe_dropped_fraction"]:.2%}' if 'moe_aux_loss' in summary else '')
    logging.info('step %d: loss %.4f%s, accuracy %.4f, lr %.3g, %.0f target tokens/s, '
                 '%.2f steps/s, %.4g model TFLOP/s%s, ETA %s', step, summary['loss'], experts,
                 summary['accuracy'], summary['learning_rate'],
                 summary['target_tokens_per_second'], steps_per_second,
                 summary['model_flops_per_second'] / 1e12,
                 f', MFU {summary["mfu"]:.1%}' if self.peak else '',
                 time.strftime('%H:%M:%S', time.gmtime(eta)))
    for name, value in summary.items():
      self.writer.add_scalar(f'train/{name}', value, step)
    self.last_loss = summary['loss']
    self.intervals.append((self.steps, elapsed, self.model_flops))
    self.sums, self.steps, self.model_flops, self.start = None, 0, 0.0, time.perf_counter()

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
