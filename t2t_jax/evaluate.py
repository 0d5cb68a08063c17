"""Translates with a trained run and prints the three BLEU figures of t2t_jax/decoding/bleu.py.

  python -m t2t_jax.evaluate --workdir=/tmp/t2t_default --src=test.src --ref=test.ref
  python -m t2t_jax.evaluate --workdir=/tmp/m30 --checkpoint=/tmp/m30/averaged/avg10_7100-8000
      (no --src/--ref: the run's own validation files)
  python -m t2t_jax.evaluate --engine=ctranslate2 --workdir=/tmp/t2t_default --src=... --ref=...
"""

import dataclasses
import sys

from absl import app
from absl import flags

from t2t_jax import cli
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import sources as sources_lib
from t2t_jax.decoding.bleu import compound_split_bleu, sacrebleu_score, search_label, tokenized_bleu


def _read(path: str, flag: str) -> list[str]:
  try:
    with open(path, encoding='utf-8') as f:
      return f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise app.UsageError(f'cannot read --{flag}={path}: {e}')


FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required')
  from t2t_jax.deploy import trained_run  # pylint: disable=g-import-not-at-top
  if bool(FLAGS.src) != bool(FLAGS.ref):
    raise app.UsageError('pass both --src and --ref, or neither to score the run\'s own '
                         'validation files')
  src, ref = (FLAGS.src, FLAGS.ref) if FLAGS.src else _validation_files(
      trained_run.load_config(FLAGS.workdir))
  sources, references = _read(src, 'src'), _read(ref, 'ref')
  tokenized = _read(FLAGS.tokenized_ref, 'tokenized_ref') if FLAGS.tokenized_ref else None
  for name, lines in (('ref', references), ('tokenized_ref', tokenized)):
    if lines is not None and len(lines) != len(sources):
      raise app.UsageError(f'--src={src} has {len(sources)} lines but --{name} has '
                           f'{len(lines)}: line N of each must belong to the same sentence')
  run = trained_run.load_from_flags(FLAGS.checkpoint, FLAGS.beam_size, FLAGS.alpha,
                                 FLAGS.batch_tokens, FLAGS.weights)
  hypotheses, _, _ = trained_run.translate_lines(run, sources, src, progress=True)
  if FLAGS.output:
    with open(FLAGS.output, 'w', encoding='utf-8') as f:
      f.write(''.join(h + '\n' for h in hypotheses))
  figures = [sacrebleu_score(hypotheses, references),
             compound_split_bleu(hypotheses, references, FLAGS.lang)]
  if tokenized is not None:
    figures.append(tokenized_bleu(hypotheses, tokenized, FLAGS.lowercase,
                                  FLAGS.tokenize_hypotheses, FLAGS.lang))
  configured = (run.config.eval.bleu_tokenize, run.config.eval.bleu_lowercase)
  if configured != ('13a', False):  # The figure the run's validation BLEU was computed as.
    bleu = sacrebleu_score(hypotheses, references, *configured)
    figures.append(dataclasses.replace(
        bleu, label=f'{bleu.label} (as configured: config.eval.bleu_tokenize='
        f'{configured[0]!r}, bleu_lowercase={configured[1]})'))
  print(f'{len(sources)} sentences of {src}, checkpoint {FLAGS.checkpoint or "latest"}'
        f'{" (moving average of the weights)" if FLAGS.weights == "ema" else ""}, '
        f'{search_label(run.translator)}')
  for bleu in figures:
    print(bleu)
  sys.stdout.flush()


def _validation_files(config) -> tuple[str, str]:
  """The run's validation source and reference files, for --src and --ref left out."""
  if config.data.source != 'text':
    raise app.UsageError(f"--src and --ref are required: this run reads "
                         f"config.data.source={config.data.source!r}, not two text files")
  return (sources_lib.in_data_dir(config.data, 'eval_src'),
          sources_lib.in_data_dir(config.data, 'eval_tgt'))


def _define_flags():
  """Defined only when run as a command, so importing this module defines no flags."""
  flags.DEFINE_string('workdir', None, 'Training run directory.')
  flags.DEFINE_string('src', None, "Source sentences, one per line; default: the run's "
                      'validation source (config.data.eval_src in config.data.data_dir).')
  flags.DEFINE_string('ref', None, 'References, line-aligned with --src; default: the '
                      "run's validation references (config.data.eval_tgt).")
  flags.DEFINE_string('tokenized_ref', '', "Optional tokenised references: adds BLEU with "
                      "tokenize='none' against them.")
  flags.DEFINE_bool('lowercase', False, 'With --tokenized_ref: lowercase both sides.')
  flags.DEFINE_bool('tokenize_hypotheses', False, 'With --tokenized_ref: Moses-tokenise the '
                    'hypotheses first.')
  flags.DEFINE_string('lang', 'de', 'Target language for Moses tokenisation.')
  flags.DEFINE_string('checkpoint', None, 'A step or a checkpoint directory; default: the '
                      'latest step.')
  flags.DEFINE_enum('weights', 'params', list(saved_params.WEIGHTS), 'Which weights of the '
                    f'checkpoint to score. {saved_params.WEIGHTS_HELP}')
  flags.DEFINE_integer('beam_size', None, 'Beam width; default: config.eval.beam_size.')
  flags.DEFINE_float('alpha', None, 'Length penalty exponent; default: config.eval.alpha.')
  flags.DEFINE_integer('batch_tokens', None, 'Tokens per decoding batch over all beams; '
                       'default: config.data.batch_tokens.')
  flags.DEFINE_string('output', '', 'Also write the translations to this file.')
  from t2t_jax.deploy import trained_run  # pylint: disable=g-import-not-at-top
  trained_run.define_engine_flags()

def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
