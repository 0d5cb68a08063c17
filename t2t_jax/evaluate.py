"""BLEU as papers report it, always through sacreBLEU, always labelled."""

import dataclasses

import sacrebleu


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
  return Bleu(result.score, 'sacreBLEU', str(metric.get_signature()))


def exact_match(hypotheses, references) -> float:
  """Percentage of hypotheses identical to their reference (after whitespace normalisation)."""
  pairs = list(zip(hypotheses, references))
  if not pairs:
    return 0.0
  return 100.0 * sum(h.split() == r.split() for h, r in pairs) / len(pairs)
