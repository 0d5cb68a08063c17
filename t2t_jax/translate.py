"""Translates text with a trained run: sentences in, translations out, in the same order.

  python -m t2t_jax.translate --workdir=/tmp/t2t_default --input=src.txt --output=out.txt
  echo "3 1 4 1 5" | python -m t2t_jax.translate --workdir=/tmp/t2t_default --beam_size=4
  python -m t2t_jax.translate --workdir=... --input=one.txt --attention_png=/tmp/attention
  python -m t2t_jax.translate --engine=ctranslate2 --workdir=... --input=src.txt --output=out.txt

--engine=ctranslate2 runs the search in CTranslate2 on the checkpoint exported to the workdir
(deploy/ctranslate2_engine.py); the input, output and their handling are the same. The run's
loading and translating is deploy/trained_run.py, which evaluate shares.
"""

import sys

from absl import app
from absl import flags
from absl import logging

from t2t_jax import cli
from t2t_jax.checkpoints import saved_params
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.deploy import trained_run


def _read_input(path: str) -> list[str]:
  if not path:
    return sys.stdin.read().splitlines()
  try:
    with open(path, encoding='utf-8') as f:
      return f.read().splitlines()
  except OSError as e:
    raise app.UsageError(f'cannot read --input={path}: {e.strerror}')
  except UnicodeDecodeError as e:
    raise app.UsageError(f'--input={path} is not UTF-8 text (byte {e.start})')


FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required')
  if FLAGS.output:
    cli.check_output_path(FLAGS.output, '--output')
  if FLAGS.attention_png and FLAGS.engine != 't2t_jax':
    raise app.UsageError("--attention_png draws the attention of t2t_jax's model: use "
                         '--engine=t2t_jax')
  lines = _read_input(FLAGS.input)
  run = trained_run.load_from_flags(FLAGS.checkpoint, FLAGS.beam_size, FLAGS.alpha,
                                    FLAGS.batch_tokens, FLAGS.weights, FLAGS.dtype)
  translations, inputs, outputs = trained_run.translate_lines(
      run, lines, FLAGS.input or '<stdin>', progress=bool(FLAGS.input))
  logging.info('%s', trained_run.summary(run.translator, outputs))
  text = ''.join(t + '\n' for t in translations)
  if FLAGS.output:
    with open(FLAGS.output, 'w', encoding='utf-8') as f:
      f.write(text)
  else:
    sys.stdout.write(text)
    sys.stdout.flush()
  if FLAGS.attention_png:
    chosen = [n for n, ids in enumerate(inputs) if len(ids)][:FLAGS.attention_lines]
    for n in chosen:
      for path in trained_run.save_attention_pngs(run, inputs[n], outputs[n],
                                                  FLAGS.attention_png, f'line{n + 1}'):
        logging.info('Wrote %s', path)


def _define_flags():
  """Defined only when run as a command, so importing this module defines no flags."""
  flags.DEFINE_string('workdir', None, 'Training run directory (config.json, checkpoints/, '
                      'vocabulary).')
  flags.DEFINE_string('checkpoint', None, 'A step of <workdir>/checkpoints, or the path of a '
                      'checkpoint directory (e.g. an averaged one); default: the latest step.')
  flags.DEFINE_enum('weights', 'params', list(saved_params.WEIGHTS), 'Which weights of the '
                    f'checkpoint translate. {saved_params.WEIGHTS_HELP}')
  flags.DEFINE_string('input', '', 'Source sentences, one per line; empty: stdin.')
  flags.DEFINE_string('output', '', 'Where translations go, one per line; empty: stdout.')
  flags.DEFINE_integer('beam_size', None, "Beam width; 1 is greedy. Default: the run's "
                       'config.eval.beam_size.', lower_bound=1)
  flags.DEFINE_float('alpha', None, 'Length penalty exponent. Default: config.eval.alpha.')
  flags.DEFINE_integer('batch_tokens', None, 'Tokens per decoding batch, counted over all '
                       'beams (rows x beam x padded source length); docs/translation.md '
                       'has the speed of each choice. Default: config.data.batch_tokens.')
  flags.DEFINE_enum('dtype', None, list(translator_lib.DECODE_DTYPES), 'Decoding activations: auto '
                    '(bfloat16 on GPU/TPU, float32 on CPU), model, float32 or bfloat16. '
                    'Default: config.eval.dtype.')
  flags.DEFINE_string('attention_png', '', 'Directory for encoder-decoder attention pictures '
                      '(one PNG per decoder layer).')
  flags.DEFINE_integer('attention_lines', 1, 'With --attention_png: how many input lines (the '
                       'first non-empty ones) get pictures.')
  trained_run.define_engine_flags()

def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
