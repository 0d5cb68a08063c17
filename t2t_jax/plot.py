"""Training curves of a run, from its TensorBoard event files, drawn into one PNG.

  python -m t2t_jax.plot --workdir=/tmp/m30 [--output=curves.png] [--bleu_target=41]

Left column against steps, right column against training wall time: training and validation
loss on top, validation BLEU (and the averaged-checkpoint BLEU when the run logged it) below,
or a run's accuracies where it has no BLEU (masked-LM pre-training, a classifier).
A resumed run writes one event file per launch; the wall-time axis joins them end to start, so
the time a run spent stopped is not counted.

It then prints, for each BLEU series, the last and best values and, with --bleu_target, when the
run first reached the target; the last line is the same as one JSON record, to compare runs by.
"""

import dataclasses
import glob
import os
import struct

from absl import app
from absl import flags

from t2t_jax import cli

# Tags written by train.py, and how the figure labels them.
LOSSES = (('train/loss', 'training loss'), ('eval/loss', 'validation loss'),
          ('averaged_eval/loss', 'validation loss, averaged checkpoints'))
BLEUS = (('bleu', 'validation BLEU'), ('averaged_bleu', 'validation BLEU, averaged checkpoints'))
# A run without BLEU (masked-LM pre-training, a classifier) draws these in BLEU's place.
ACCURACIES = (('train/accuracy', 'training accuracy'), ('eval/accuracy', 'validation accuracy'),
              ('eval/macro_f1', 'validation macro F1'))
RATES = (('train/steps_per_second', 'updates/s, per log interval (saving and evaluating '
          'included)'),)


@dataclasses.dataclass
class Series:
  """One scalar over a run: steps, values and training seconds at which each was written."""
  steps: list[int] = dataclasses.field(default_factory=list)
  values: list[float] = dataclasses.field(default_factory=list)
  seconds: list[float] = dataclasses.field(default_factory=list)


def _records(path: str):
  """The serialised events of one event file (TFRecord framing); a torn last record ends it."""
  with open(path, 'rb') as f:
    while len(header := f.read(12)) == 12:
      (length,) = struct.unpack('<Q', header[:8])
      data = f.read(length)
      if len(data) < length or len(f.read(4)) < 4:
        return  # Still being written by a live run.
      yield data


def read_scalars(workdir: str) -> dict[str, Series]:
  """{tag: Series} from every event file in `workdir`, launches joined in time order.

  Later launches overwrite the values of steps an earlier launch also logged (a resume
  repeats the steps after its checkpoint), so each step keeps the value of its last launch.
  """
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  paths = glob.glob(os.path.join(workdir, 'events.out.tfevents.*'))
  if not paths:
    raise FileNotFoundError(f'no TensorBoard event files (events.out.tfevents.*) in {workdir}')
  launches = []
  for path in paths:
    events = [event_pb2.Event.FromString(record) for record in _records(path)]
    if events:
      launches.append(events)
  launches.sort(key=lambda events: events[0].wall_time)
  points: dict[str, dict[int, tuple[float, float]]] = {}
  offset = 0.0
  for events in launches:
    start = events[0].wall_time  # The file_version event, written when the writer opened.
    for event in events:
      for value in event.summary.value:
        points.setdefault(value.tag, {})[event.step] = (value.simple_value,
                                                       offset + event.wall_time - start)
    offset += events[-1].wall_time - start
  scalars = {}
  for tag, by_step in points.items():
    series = scalars[tag] = Series()
    for step in sorted(by_step):
      series.steps.append(step)
      series.values.append(by_step[step][0])
      series.seconds.append(by_step[step][1])
  return scalars


def time_to_target(series: Series, target: float) -> dict[str, float] | None:
  """The first logged point with value >= target ({step, seconds, minutes, value}); None if none.

  The seconds are training wall time when the value was logged, so they include the
  evaluations (and the BLEU decoding) that ran before it.
  """
  for step, value, seconds in zip(series.steps, series.values, series.seconds):
    if value >= target:
      return {'step': step, 'seconds': seconds, 'minutes': seconds / 60, 'value': value}
  return None


def _best(series: Series) -> int:
  """Index of the highest value; the earliest one on ties."""
  return max(range(len(series.values)), key=series.values.__getitem__)


def summary(scalars: dict[str, Series], workdir: str,
            bleu_target: float = 0.0) -> tuple[list[str], dict]:
  """The lines to print about each BLEU series, and the same figures as one JSON record.

  The record holds {tag: {last, last_step, best, best_step, best_minutes, minutes_to_target,
  step_to_target}} for each BLEU tag the run logged, with a reason in null_reasons for each
  null, the run's total training minutes, and the median and range of its updates/s per log
  interval (the first interval, which compiles, left out).
  """
  lines = []
  reasons = {}
  record = {'workdir': workdir, 'bleu_target': bleu_target or None,
            'training_minutes': round(max((series.seconds[-1] for series in scalars.values()
                                           if series.seconds), default=0.0) / 60, 2)}
  if not bleu_target:
    reasons['bleu_target'] = 'no --bleu_target given'
  for tag, _ in BLEUS:
    if not (series := scalars.get(tag)):
      continue
    best = _best(series)
    best_text = (f'best {series.values[best]:.2f} at step {series.steps[best]}, '
                 f'{series.seconds[best] / 60:.1f} training minutes')
    lines.append(f'{tag}: last {series.values[-1]:.2f} at step {series.steps[-1]}; '
                 f'{best_text}')
    figures = record[tag] = {
        # Event files hold float32: 41.2 reads back as 41.20000076.
        'last': round(series.values[-1], 4), 'last_step': series.steps[-1],
        'best': round(series.values[best], 4), 'best_step': series.steps[best],
        'best_minutes': round(series.seconds[best] / 60, 2),
        'minutes_to_target': None, 'step_to_target': None}
    reached = time_to_target(series, bleu_target) if bleu_target else None
    if reached:
      figures['minutes_to_target'] = round(reached['minutes'], 2)
      figures['step_to_target'] = reached['step']
      lines.append(f'{tag}: first reached {bleu_target:g} at step {reached["step"]} after '
                   f'{reached["minutes"]:.1f} training minutes ({reached["value"]:.2f})')
    else:
      why = f'never reached {bleu_target:g} ({best_text})' if bleu_target else (
          'no --bleu_target given')
      if bleu_target:
        lines.append(f'{tag}: {why}')
      reasons[f'{tag}.minutes_to_target'] = reasons[f'{tag}.step_to_target'] = why
  if rates := scalars.get('train/steps_per_second'):
    ordered = sorted(rates.values[1:] or rates.values)  # The first interval compiles.
    spread = {'median': ordered[len(ordered) // 2], 'min': ordered[0], 'max': ordered[-1],
              'intervals': len(ordered)}
    record['steps_per_second'] = {k: round(v, 3) for k, v in spread.items()}
    lines.append(f'updates/s per log interval (the first left out): median '
                 f'{spread["median"]:.2f}, {spread["min"]:.2f} to {spread["max"]:.2f} over '
                 f'{len(ordered)} intervals')
  record['null_reasons'] = reasons
  return lines, record


def middle_row(scalars: dict[str, Series]) -> tuple[tuple, str]:
  """The figure's second row: BLEU where the run logged any, else its accuracies."""
  if any(tag in scalars for tag, _ in BLEUS):
    return BLEUS, 'BLEU'
  return ACCURACIES, 'accuracy'


def draw(scalars: dict[str, Series], output: str, title: str = '',
         bleu_target: float = 0.0) -> None:
  """Writes the 3x2 figure (loss, BLEU or accuracy, and updates/s against steps and hours) to
  `output`."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top

  figure, axes = plt.subplots(3, 2, figsize=(12, 11), sharex='col')
  for column, (x_name, x_label) in enumerate((('steps', 'training steps'),
                                              ('seconds', 'training wall time (hours)'))):
    for row, (series_list, y_label) in enumerate(((LOSSES, 'loss'), middle_row(scalars),
                                                  (RATES, 'updates/s'))):
      ax = axes[row][column]
      for tag, label in series_list:
        if tag not in scalars:
          continue
        series = scalars[tag]
        xs = getattr(series, x_name)
        if x_name == 'seconds':
          xs = [x / 3600 for x in xs]
        style = '-' if tag.startswith('train') else 'o-'
        ax.plot(xs, series.values, style, label=label, markersize=3)
      if row == 1 and bleu_target:
        ax.axhline(bleu_target, color='gray', linestyle='--', label=f'target {bleu_target:g}')
      ax.set_ylabel(y_label)
      ax.grid(alpha=0.3)
      if ax.has_data():
        ax.legend(fontsize=8)
      if row == 2:
        ax.set_xlabel(x_label)
  if title:
    figure.suptitle(title)
  figure.tight_layout()
  figure.savefig(output, dpi=120)
  plt.close(figure)


FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required')
  if FLAGS.bleu_target < 0:
    raise app.UsageError(f'--bleu_target={FLAGS.bleu_target:g}: give a BLEU above 0, or 0 for '
                         'no target')
  try:
    scalars = read_scalars(FLAGS.workdir)
  except FileNotFoundError as e:
    raise app.UsageError(f'{e}: --workdir must be a training run directory') from None
  if not any(tag in scalars for tag, _ in LOSSES + BLEUS):
    raise app.UsageError(f'the event files in {FLAGS.workdir} hold no training or evaluation '
                         'scalars yet')
  output = FLAGS.output or os.path.join(FLAGS.workdir, 'curves.png')
  draw(scalars, output, FLAGS.title or os.path.basename(os.path.normpath(FLAGS.workdir)),
       FLAGS.bleu_target)
  print(f'wrote {output}')
  lines, record = summary(scalars, FLAGS.workdir, FLAGS.bleu_target)
  for line in lines:
    print(line)
  print(cli.json_line(record))


def _define_flags():
  """Defined only when run as a command, so importing this module defines no flags."""
  flags.DEFINE_string('workdir', None, 'Training run directory (holds the event files).')
  flags.DEFINE_string('output', '', 'PNG to write; default: <workdir>/curves.png.')
  flags.DEFINE_string('title', '', 'Figure title; default: the workdir name.')
  flags.DEFINE_float('bleu_target', 0.0, 'Draw a dashed line at this BLEU and report when the '
                     'run first reached it; 0: none.')


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
