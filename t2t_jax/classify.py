"""Labels text with a fine-tuned classifier (or regressor): one line per input line, in order.

  python -m t2t_jax.classify --workdir=/tmp/sst2 --input=sentences.txt --output=labels.tsv
  python -m t2t_jax.classify --workdir=/tmp/sst2 --input=valid.tsv --output=labels.tsv \
      --confusion_png=/tmp/sst2/confusion.png

A '.tsv' input is labelled text as training reads it (text, optional text2, label; with or
without a header): its gold labels are scored (accuracy, macro F1, Matthews correlation) and
--confusion_png draws their confusion matrix. Other input is one text a line (a tab between
the two texts of a pair). The output has a header line, then per input line the predicted label
and each label's probability (a regressor: its value). The parameters are the best step's
unless --checkpoint names others (deploy/classifier_run.py).
"""

import collections
import sys

from absl import app
from absl import flags
from absl import logging
import numpy as np

from t2t_jax import cli
from t2t_jax.data import classification
from t2t_jax.data.sources import DataError

FLAGS = flags.FLAGS


def read_text(path: str) -> classification.LabelledText:
  """One text (or a tab-separated pair) a line, without labels; an empty line is an error."""
  texts, texts2, lines = [], [], []
  try:
    with open(path, encoding='utf-8') as f:
      for number, line in enumerate(f, start=1):
        text, _, text2 = line.rstrip('\r\n').partition('\t')
        if not text.strip():
          raise DataError(f'{path}:{number}: empty line: every line is a text to classify')
        texts.append(text.strip())
        texts2.append(text2.strip())
        lines.append(number)
  except OSError as e:
    raise DataError(f'cannot read {path}: {e.strerror}') from None
  except UnicodeDecodeError as e:
    raise DataError(f'{path}: not valid UTF-8 (byte {e.start})') from None
  if not texts:
    raise DataError(f'{path}: no lines to classify')
  pairs = any(texts2)
  return classification.LabelledText(texts, texts2 if pairs else None, [''] * len(texts),
                                     lines, path)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.workdir or not FLAGS.input:
    raise app.UsageError('--workdir and --input are required')
  if FLAGS.output:
    cli.check_output_path(FLAGS.output, '--output')
  from t2t_jax.deploy import classifier_run  # pylint: disable=g-import-not-at-top
  from t2t_jax.training import classifier_eval  # pylint: disable=g-import-not-at-top
  classifier = classifier_run.load(FLAGS.workdir, FLAGS.checkpoint)
  labelled = FLAGS.input.endswith('.tsv')
  data = (classification.read_tsv(FLAGS.input, 'error') if labelled
          else read_text(FLAGS.input))
  if not labelled:  # encode needs a label from the set: any serves, it is not read.
    data.labels = [classifier.names[0] if classifier.names else '0'] * len(data.texts)
  outputs = classifier_run.predict(classifier, data)
  regression = classifier.regression
  predicted = (outputs[:, 0] if regression else np.asarray(classifier.names)[outputs.argmax(-1)])
  header = ['value'] if regression else ['label'] + [f'p({name})' for name in classifier.names]
  rows = ([f'{v:.6g}'] if regression else [label] + [f'{p:.6f}' for p in probs]
          for v, label, probs in zip(outputs[:, 0], predicted, outputs))
  text = '\t'.join(header) + '\n' + ''.join('\t'.join(row) + '\n' for row in rows)
  if FLAGS.output:
    with open(FLAGS.output, 'w', encoding='utf-8') as f:
      f.write(text)
  else:
    print(text, end='')
  logging.info('Classified %d lines of %s with %s: %s', len(outputs), FLAGS.input,
               classifier.source, dict(collections.Counter(map(str, predicted)).most_common(10))
               if not regression else 'values')
  if labelled:
    gold = (np.asarray(data.labels, np.float32) if regression else
            np.asarray([classifier.names.index(label) for label in data.labels]))
    guesses = outputs[:, 0] if regression else outputs.argmax(-1)
    figures = classifier_eval.scores(gold, guesses, regression)
    print(cli.json_line({'input': FLAGS.input, 'lines': len(outputs), **figures}),
          file=sys.stderr)
    if FLAGS.confusion_png and not regression:
      _confusion_png(gold, guesses, classifier.names, FLAGS.confusion_png)
  elif FLAGS.confusion_png:
    raise app.UsageError('--confusion_png needs gold labels: pass a labelled .tsv --input')


def _confusion_png(gold, guesses, names, path: str) -> None:
  """The confusion matrix of gold against predicted labels, counts in each cell."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  from sklearn import metrics  # pylint: disable=g-import-not-at-top
  figure, axes = plt.subplots(figsize=(1.2 * len(names) + 3, 1.2 * len(names) + 2.5))
  metrics.ConfusionMatrixDisplay.from_predictions(
      gold, guesses, labels=list(range(len(names))), display_labels=names, ax=axes,
      colorbar=False, xticks_rotation=45)
  axes.set_title('confusion matrix (rows: gold, columns: predicted)')
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  plt.close(figure)
  logging.info('Wrote %s', path)


def _define_flags():
  """Defined only when run as a command, so importing this module defines no flags."""
  flags.DEFINE_string('workdir', None, 'The fine-tuning run directory (config.json, '
                      'checkpoints/, best_params/).')
  flags.DEFINE_string('checkpoint', None, 'A step of <workdir>/checkpoints, or the path of a '
                      'checkpoint directory; default: <workdir>/best_params, else the latest.')
  flags.DEFINE_string('input', None, "Text to classify: a labelled '.tsv' file (scored), "
                      'else one text a line.')
  flags.DEFINE_string('output', '', 'Where predictions go, one line each after a header; '
                      'empty: stdout.')
  flags.DEFINE_string('confusion_png', '', 'With a labelled .tsv input: the confusion matrix '
                      'picture to write.')


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
