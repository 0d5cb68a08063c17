"""BLEU as papers report it, always through sacreBLEU, always labelled.

Three figures:
  * sacreBLEU: detokenised output against raw references, with sacreBLEU's signature (primary).
  * tokenised BLEU with compound splitting, as tensor2tensor's get_ende_bleu.sh computed the
    paper's WMT14 en-de numbers: Moses tokenisation of both sides, then every `-` between two
    non-space characters becomes ` ##AT##-##AT## `, then BLEU on the resulting tokens.
  * tokenised BLEU (tokenize='none') against references that are already tokenised, with
    optional lowercasing and Moses tokenisation of the hypotheses.

  python -m t2t_jax.evaluate --workdir=/tmp/t2t_default --src=test.src --ref=test.ref
  python -m t2t_jax.evaluate --workdir=/tmp/m30 --checkpoint=/tmp/m30/averaged/avg10_7100-8000
      (no --src/--ref: the run's own validation files)
  python -m t2t_jax.evaluate --engine=ctranslate2 --workdir=/tmp/t2t_default --src=... --ref=...
"""

import dataclasses
import json
import os
import re
import sys
from typing import Sequence

from absl import app
from absl import flags
from absl import logging
import sacrebleu

from t2t_jax import cli
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import sources as sources_lib


@dataclasses.dataclass(frozen=True)
class Bleu:
  score: float
  label: str  # Which BLEU this is, e.g. 'sacreBLEU' or 'tokenised BLEU (compound split)'.
  signature: str

  def __str__(self):
    return f'{self.label} {self.score:.2f} ({self.signature})'


def sacrebleu_score(hypotheses, references, tokenize: str = '13a',
                    lowercase: bool = False) -> Bleu:
  """Corpus BLEU of detokenised hypotheses against raw references, with its signature."""
  metric = sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=lowercase)
  result = metric.corpus_score(list(hypotheses), [list(references)])
  label = 'tokenised BLEU' if tokenize == 'none' else 'sacreBLEU'
  return Bleu(result.score, label, str(metric.get_signature()))


def moses_tokenize(lines: Sequence[str], lang: str) -> list[str]:
  """Moses tokenisation (tokenizer.perl defaults: escaping on, no aggressive dash splits)."""
  from sacremoses import MosesTokenizer  # pylint: disable=g-import-not-at-top
  tokenizer = MosesTokenizer(lang=lang)
  return [tokenizer.tokenize(line, return_str=True) for line in lines]


_COMPOUND = re.compile(r'(\S)-(\S)')


def split_compounds(line: str) -> str:
  """get_ende_bleu.sh's `s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g`, with its non-overlapping scan."""
  return _COMPOUND.sub(r'\1 ##AT##-##AT## \2', line)


def compound_split_bleu(hypotheses, references, lang: str = 'de') -> Bleu:
  """The paper-comparable figure: Moses-tokenised, compound-split BLEU (tensor2tensor)."""
  sides = [[split_compounds(line) for line in moses_tokenize(lines, lang)]
           for lines in (hypotheses, references)]
  metric = sacrebleu.metrics.BLEU(tokenize='none')
  result = metric.corpus_score(sides[0], [sides[1]])
  return Bleu(result.score, f'tokenised BLEU, compound split (Moses {lang}, tensor2tensor '
              'get_ende_bleu)', str(metric.get_signature()))


def tokenized_bleu(hypotheses, tokenized_references, lowercase: bool = False,
                   tokenize_hypotheses: bool = False, lang: str = 'en') -> Bleu:
  """BLEU with tokenize='none' against already tokenised references."""
  hypotheses = list(hypotheses)
  if tokenize_hypotheses:
    hypotheses = moses_tokenize(hypotheses, lang)
  metric = sacrebleu.metrics.BLEU(tokenize='none', lowercase=lowercase)
  result = metric.corpus_score(hypotheses, [list(tokenized_references)])
  details = ['tokenised references'] + (['lowercased'] if lowercase else []) + (
      [f'hypotheses Moses-tokenised ({lang})'] if tokenize_hypotheses else [])
  return Bleu(result.score, f'tokenised BLEU ({", ".join(details)})',
              str(metric.get_signature()))


def search_label(translator) -> str:
  """How `translator` searched, as the BLEU lines say it: 'beam 4, alpha 0.6', with a length
  penalty other than GNMT's and the CTranslate2 engine named."""
  label = f'beam {translator.beam_size}, alpha {translator.alpha}'
  if translator.length_penalty != 'gnmt':
    label += f', length penalty {translator.length_penalty}'
  if translator.engine == 'ctranslate2':
    label += f', CTranslate2 {translator.compute_type}'
    if translator.search.patience is not None:
      label += f', patience {translator.search.patience}'
  return label


def exact_match(hypotheses, references) -> float:
  """Percentage of hypotheses identical to their reference (after whitespace normalisation)."""
  pairs = list(zip(hypotheses, references))
  if not pairs:
    return 0.0
  return 100.0 * sum(h.split() == r.split() for h, r in pairs) / len(pairs)


# BLEU during training.

def bleu_sentences_due(step: int, num_steps: int, eval_config) -> int:
  """Eval sentences the evaluation at `step` decodes for BLEU: 0 none, -1 all, N the first N.

  `eval.bleu_sentences` at multiples of `eval.bleu_every` and at the last step, which decodes
  all of them instead with `eval.full_bleu_at_end`.
  """
  if step == num_steps and eval_config.get('full_bleu_at_end'):
    return -1
  due = step == num_steps or eval_config.bleu_every <= 0 or step % eval_config.bleu_every == 0
  return eval_config.bleu_sentences if due else 0


def validation_bleu(translator, params, split, vocab, eval_config, examples_to_print: int = 0,
                    sentences: int | None = None) -> tuple[dict[str, float], Bleu]:
  """sacreBLEU and exact match on the validation set: its first `sentences` if > 0, all if < 0.

  `sentences` defaults to `eval_config.bleu_sentences`.
  """
  sentences = eval_config.bleu_sentences if sentences is None else sentences
  count = len(split) if sentences < 0 else min(sentences, len(split))
  references = split.references[:count]
  hypotheses = [vocab.decode(ids) for ids in translator.translate(params, split.inputs[:count])]
  bleu = sacrebleu_score(hypotheses, references, eval_config.bleu_tokenize,
                         eval_config.bleu_lowercase)
  how = 'greedy' if translator.beam_size == 1 else search_label(translator)
  logging.info('%s on %d validation sentences (%s)', bleu, count, how)
  for source, reference, hypothesis in list(zip(split.sources, references,
                                               hypotheses))[:examples_to_print]:
    logging.info('  source:     %s\n  reference:  %s\n  hypothesis: %s', source, reference,
                 hypothesis)
  return {'bleu': bleu.score, 'exact_match': exact_match(hypotheses, references)}, bleu


def record_best_bleu(workdir: str, step: int, bleu: Bleu) -> bool:
  """Keeps <workdir>/best_bleu.json naming the step with the highest BLEU; True if `step` is it."""
  path = os.path.join(workdir, 'best_bleu.json')
  if os.path.exists(path):
    with open(path) as f:
      best = json.load(f)
    if best['bleu'] >= bleu.score and best['step'] != step:
      return False
  record = {'step': step, 'bleu': bleu.score, 'label': bleu.label, 'signature': bleu.signature}
  with open(path + '.tmp', 'w') as f:
    json.dump(record, f)
  os.replace(path + '.tmp', path)
  return True


# The command line: translate and score in one step.



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
  from t2t_jax import translate  # pylint: disable=g-import-not-at-top
  if bool(FLAGS.src) != bool(FLAGS.ref):
    raise app.UsageError('pass both --src and --ref, or neither to score the run\'s own '
                         'validation files')
  src, ref = (FLAGS.src, FLAGS.ref) if FLAGS.src else _validation_files(
      translate.load_config(FLAGS.workdir))
  sources, references = _read(src, 'src'), _read(ref, 'ref')
  tokenized = _read(FLAGS.tokenized_ref, 'tokenized_ref') if FLAGS.tokenized_ref else None
  for name, lines in (('ref', references), ('tokenized_ref', tokenized)):
    if lines is not None and len(lines) != len(sources):
      raise app.UsageError(f'--src={src} has {len(sources)} lines but --{name} has '
                           f'{len(lines)}: line N of each must belong to the same sentence')
  run = translate.load_from_flags(FLAGS.checkpoint, FLAGS.beam_size, FLAGS.alpha,
                                 FLAGS.batch_tokens, FLAGS.weights)
  hypotheses, _, _ = translate.translate_lines(run, sources, src, progress=True)
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
  from t2t_jax import translate  # pylint: disable=g-import-not-at-top
  translate.define_engine_flags()

def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
