"""BLEU as papers report it, always through sacreBLEU, always labelled (the evaluate
command and the in-training evaluation both score with it).

Three figures:
  * sacreBLEU: detokenised output against raw references, with sacreBLEU's signature (primary).
  * tokenised BLEU with compound splitting, as tensor2tensor's get_ende_bleu.sh computed the
    paper's WMT14 en-de numbers: Moses tokenisation of both sides, then every `-` between two
    non-space characters becomes ` ##AT##-##AT## `, then BLEU on the resulting tokens.
  * tokenised BLEU (tokenize='none') against references that are already tokenised, with
    optional lowercasing and Moses tokenisation of the hypotheses.
"""

import dataclasses
import json
import os
import re
from typing import Sequence

from absl import logging
import sacrebleu

from t2t_jax.decoding import translator as translator_lib

from t2t_jax import workdir_layout


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
  path = os.path.join(workdir, workdir_layout.BEST_BLEU_JSON)
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


class ValidationBleu:
  """A translation run's evaluator (training/task.py): sacreBLEU and exact match of the
  validation sentences due at each step (`bleu_sentences_due`), decoded by `translator`; the
  step of the best BLEU of the run's own parameters is kept in best_bleu.json."""

  def __init__(self, translator, split, vocab, eval_config, num_steps: int):
    self.translator, self.split, self.vocab = translator, split, vocab
    self.eval_config, self.num_steps = eval_config, num_steps
    self._primary: tuple[int, Bleu] | None = None  # The run's params' latest (step, BLEU).

  @classmethod
  def for_run(cls, context) -> 'ValidationBleu':
    """The evaluator of a launch (a task.EvalContext): a translator on its mesh and rules."""
    config, setup = context.config, context.setup
    translator = translator_lib.from_config(config, setup.model_config, setup.mesh,
                                            setup.axis_rules, dtype=context.eval_dtype)
    return cls(translator, context.data.eval, context.data.vocab, config.eval,
               config.train.num_steps)

  def __call__(self, params, step: int, primary: bool = True) -> dict[str, float]:
    sentences = bleu_sentences_due(step, self.num_steps, self.eval_config)
    if not sentences or not len(self.split):
      return {}
    figures, bleu = validation_bleu(self.translator, params, self.split, self.vocab,
                                    self.eval_config, self.eval_config.examples_to_print,
                                    sentences)
    if primary:
      self._primary = (step, bleu)
    return figures

  def record(self, workdir: str, step: int) -> None:
    if self._primary and self._primary[0] == step:
      record_best_bleu(workdir, step, self._primary[1])
