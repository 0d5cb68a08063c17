"""Translates text with a trained run: sentences in, translations out, in the same order.

  python -m t2t_jax.translate --workdir=/tmp/t2t_default --input=src.txt --output=out.txt
  echo "3 1 4 1 5" | python -m t2t_jax.translate --workdir=/tmp/t2t_default --beam_size=4
  python -m t2t_jax.translate --workdir=... --input=one.txt --attention_png=/tmp/attention
  python -m t2t_jax.translate --engine=ctranslate2 --workdir=... --input=src.txt --output=out.txt

  python -m t2t_jax.translate --workdir=... --input=mono.de --output=mono.bt.en \
      --sampling=sample --top_k=10 --seed=1 --process_index=0 --process_count=4

--engine=ctranslate2 runs the search in CTranslate2 on the checkpoint exported to the workdir
(deploy/ctranslate2_engine.py); the input, output and their handling are the same. The run's
loading and translating is deploy/trained_run.py, which evaluate shares. With --input and
--output files the input is translated in chunks, each saved as it finishes, so the same
command resumes after a kill and several processes can share the file
(deploy/file_translation.py); docs/backtranslation.md has the recipes.
"""

import os
import sys

from absl import app
from absl import flags
from absl import logging

from t2t_jax import cli
from t2t_jax.checkpoints import saved_params
from t2t_jax.decoding import sampling as sampling_lib
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.deploy import file_translation
from t2t_jax.deploy import trained_run


FLAGS = flags.FLAGS


def _sampling_from_flags() -> tuple[sampling_lib.Sampling | None, sampling_lib.Noise | None]:
  """--sampling's draws: the sampled search's options, or the noise of a noised beam."""
  chosen = [name for name in ('temperature', 'top_k', 'top_p') if FLAGS[name].present]
  if FLAGS.sampling != 'sample' and chosen:
    raise app.UsageError(f'--{chosen[0]} shapes what --sampling=sample draws from')
  if FLAGS.sampling == 'none':
    if FLAGS.samples != 1 or FLAGS['seed'].present:
      raise app.UsageError('--samples and --seed apply to --sampling=sample or noised_beam')
    return None, None
  if FLAGS.attention_png:
    raise app.UsageError('--attention_png draws one search\'s attention: not with --sampling')
  if FLAGS.sampling == 'noised_beam':
    return None, sampling_lib.Noise(seed=FLAGS.seed)
  if FLAGS.engine != 't2t_jax':
    raise app.UsageError("--sampling=sample runs t2t_jax's search (its draws are reproducible "
                         'line by line): use --engine=t2t_jax')
  if FLAGS.beam_size not in (None, 1):
    raise app.UsageError('--sampling=sample draws one token at a time: no --beam_size')
  return sampling_lib.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.seed), None


def _options() -> dict:
  """The flags a translation's outputs depend on, for the chunks' manifest: the checkpoint as
  the path it resolves to (the latest step is pinned, not 'whichever is latest')."""
  names = ('weights', 'beam_size', 'alpha', 'length_penalty', 'dtype', 'engine',
           'ct2_compute_type', 'ct2_patience', 'sampling', 'temperature', 'top_k', 'top_p',
           'seed', 'samples')
  checkpoint = saved_params.checkpoint_path(FLAGS.workdir, FLAGS.checkpoint)
  return {'checkpoint': os.path.abspath(checkpoint),
          **{name: FLAGS[name].value for name in names}}


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
  sampling, noise = _sampling_from_flags()
  chunked = bool(FLAGS.input and FLAGS.output and FLAGS.chunk_lines and not FLAGS.attention_png)
  if not chunked and (FLAGS.process_count != 1 or FLAGS.process_index):
    raise app.UsageError('--process_index and --process_count share an --input file\'s '
                         'chunks: give --input, --output and --chunk_lines')
  if chunked:
    plan = file_translation.Plan(FLAGS.input, FLAGS.output, FLAGS.chunk_lines,
                                 FLAGS.process_index, FLAGS.process_count, FLAGS.samples,
                                 _options())
    if not os.path.isfile(FLAGS.input):
      raise app.UsageError(f'cannot read --input={FLAGS.input}: no such file')
  else:
    lines = cli.read_input_lines(FLAGS.input)
  run = trained_run.load_from_flags(FLAGS.checkpoint, FLAGS.beam_size, FLAGS.alpha,
                                    FLAGS.batch_tokens, FLAGS.weights, FLAGS.dtype, sampling)
  if chunked:
    _translate_file(run, plan, noise)
  else:
    _translate_lines(run, lines, noise)


def _translate_file(run: trained_run.Run, plan: file_translation.Plan,
                    noise: sampling_lib.Noise | None) -> None:
  """--input translated in chunks into --output (deploy/file_translation.py)."""
  tokens = 0  # Output tokens, for the throughput line.

  def translate_chunk(lines, first_line):
    nonlocal tokens
    translations, _, outputs = trained_run.translate_lines(
        run, lines, FLAGS.input, samples=FLAGS.samples, first_line=first_line, noise=noise)
    tokens += sum(len(ids) for ids in outputs)
    return translations

  outcome = file_translation.translate_file(plan, translate_chunk)
  logging.info('%s: %d lines in %d chunks; this process translated %d of them in %.1f s '
               '(%.1f lines/s)%s', FLAGS.input, outcome.lines, outcome.chunks,
               outcome.translated, outcome.seconds,
               outcome.translated / max(outcome.seconds, 1e-9),
               f'; wrote {FLAGS.output}' if outcome.merged else
               '; other chunks are still to do, so --output is not written yet')
  if outcome.translated:
    logging.info('%s', trained_run.summary(run.translator, tokens))


def _translate_lines(run: trained_run.Run, lines: list[str],
                     noise: sampling_lib.Noise | None) -> None:
  """Lines read whole, translated, written to --output or stdout; attention pictures."""
  translations, inputs, outputs = trained_run.translate_lines(
      run, lines, FLAGS.input or '<stdin>', progress=bool(FLAGS.input), samples=FLAGS.samples,
      noise=noise)
  logging.info('%s', trained_run.summary(run.translator, sum(len(ids) for ids in outputs)))
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
  flags.DEFINE_enum('sampling', 'none', list(sampling_lib.KINDS), 'none: the search '
                    '(--beam_size); sample: each token drawn from the softmax, shaped by '
                    '--temperature, --top_k and --top_p; noised_beam: the beam output with '
                    "words deleted (p 0.1), replaced by '<blank>' (p 0.1) and shuffled within 3 "
                    'positions (Edunov et al. 2018).')
  flags.DEFINE_float('temperature', 1.0, '--sampling=sample: the softmax of logits / this; 0 '
                     'is greedy.', lower_bound=0.0)
  flags.DEFINE_integer('top_k', 0, '--sampling=sample: draw from the k likeliest tokens only; '
                       '0: all.', lower_bound=0)
  flags.DEFINE_float('top_p', 1.0, '--sampling=sample: draw from the smallest set of likeliest '
                     'tokens holding this much probability (nucleus sampling); 1: all.')
  flags.DEFINE_integer('seed', 0, '--sampling: the draws depend on it, on the line\'s index and '
                       'on the sample\'s number only, never on batching or processes.')
  flags.DEFINE_integer('samples', 1, '--sampling: outputs per input line, one after the other.',
                       lower_bound=1)
  flags.DEFINE_integer('chunk_lines', 10000, 'With --input and --output files: lines per chunk, '
                       'each saved under <output>.parts/ when done, so the same command resumes '
                       'after a kill; 0: the whole file in memory at once.', lower_bound=0)
  flags.DEFINE_integer('process_index', 0, 'This process\'s share of the chunks: those whose '
                       'number modulo --process_count is this (e.g. $SLURM_ARRAY_TASK_ID).',
                       lower_bound=0)
  flags.DEFINE_integer('process_count', 1, 'How many processes share the chunks; the one that '
                       'finds them all done writes --output.', lower_bound=1)
  trained_run.define_engine_flags()

def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
