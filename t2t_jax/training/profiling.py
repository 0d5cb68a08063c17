"""A profile on request: a jax.profiler trace of the steps config.train.profile_steps names.

The trace goes to workdir_layout.profile_dir, as each host's XPlane and trace-event JSON and, on
a one-process run, a Perfetto JSON; TensorBoard's profile plugin, XProf and Perfetto open it
(docs/performance.md, "A profile of chosen steps").
"""

import contextlib
from typing import Any, Iterator, Sequence

from absl import logging
import jax


class StepProfile:
  """Starts the trace before step `first` runs and stops it once step `last` has finished."""

  def __init__(self, steps: Sequence[int], directory: str):
    self.first, self.last = (int(steps[0]), int(steps[1])) if steps else (0, -1)
    self.directory = directory
    self.started = self.latest = None  # The first and latest step dispatched while tracing.

  def before(self, step: int) -> None:
    """Called before `step` is dispatched; a resumed run that starts inside the window starts
    the trace at its first step."""
    if self.started is None and self.first <= step <= self.last:
      # JAX writes the Perfetto file from the one trace JSON it finds in the newest folder:
      # several processes writing to a shared workdir would leave it several, or the wrong one.
      jax.profiler.start_trace(self.directory,
                               create_perfetto_trace=jax.process_count() == 1)
      self.started = step
    if self.started is not None:
      self.latest = step

  def after(self, step: int, outputs: Any) -> None:
    """Called with what `step` returned, once it is dispatched: at `last`, waits for the device
    to finish the step, so that the trace holds all of it, and writes the trace."""
    if self.started is not None and step == self.last:
      jax.block_until_ready(outputs)
      self.stop()

  def annotate(self, step: int):
    """Marks the host's dispatch of `step` as a training step in the trace (TensorBoard's and
    XProf's step views group by it); nothing outside a trace, so the loop pays nothing for
    the steps no one profiles."""
    if self.started is None:
      return contextlib.nullcontext()
    return jax.profiler.StepTraceAnnotation('train', step_num=step)

  def stop(self) -> None:
    """Writes the trace, if one is running."""
    if self.started is not None:
      jax.profiler.stop_trace()
      logging.info('Profile of steps %d to %d written to %s (docs/performance.md, "A profile '
                   'of chosen steps")', self.started, self.latest, self.directory)
      self.started = self.latest = None


@contextlib.contextmanager
def window(steps: Sequence[int], directory: str) -> Iterator[StepProfile]:
  """A StepProfile whose trace is written also where the run ends inside the window (its last
  step, a signal, a pruner, an error)."""
  profile = StepProfile(steps, directory)
  try:
    yield profile
  finally:
    profile.stop()
