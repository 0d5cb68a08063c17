"""BLEU modes against sacreBLEU called directly, compound splitting, best-step bookkeeping."""

import json
import types

import ml_collections
import pytest
import sacrebleu

from t2t_jax.decoding import bleu as bleu_lib

HYPOTHESES = ['Die Ein-Mann-Firma kostet 3,5 Mio. Euro.', 'Der US-Präsident sprach.',
              'Es ist "gut" & schnell.']
REFERENCES = ['Die Ein-Mann-Firma kostete 3,5 Mio. Euro.', 'Der US-Präsident sprach gestern.',
              'Es ist "gut" und schnell.']


def test_sacrebleu_is_sacrebleu_on_raw_text_with_its_signature():
  bleu = bleu_lib.sacrebleu_score(HYPOTHESES, REFERENCES)
  assert bleu.score == pytest.approx(sacrebleu.corpus_bleu(HYPOTHESES, [REFERENCES]).score)
  assert bleu.label == 'sacreBLEU' and 'tok:13a' in bleu.signature
  assert str(bleu).startswith(f'sacreBLEU {bleu.score:.2f} (nrefs:1|')


@pytest.mark.parametrize('line, expected', [
    ('Ein-Mann-Firma', 'Ein ##AT##-##AT## Mann ##AT##-##AT## Firma'),
    ('US-Präsident', 'US ##AT##-##AT## Präsident'),
    # The scan does not overlap: the `b` consumed by the first match cannot start a second.
    ('a-b-c', 'a ##AT##-##AT## b-c'),
    ('5 - 3 , -2 und x-', '5 - 3 , -2 und x-'),
])
def test_compound_splitting_matches_hand_worked_examples(line, expected):
  assert bleu_lib.split_compounds(line) == expected


def test_compound_split_bleu_is_sacrebleu_on_hand_tokenised_split_text():
  # Moses (de) tokenisation, escaping included, then compound splitting, worked by hand.
  hypotheses = ['Die Ein ##AT##-##AT## Mann ##AT##-##AT## Firma kostet 3,5 Mio. Euro .',
                'Der US ##AT##-##AT## Präsident sprach .',
                'Es ist &quot; gut &quot; &amp; schnell .']
  references = ['Die Ein ##AT##-##AT## Mann ##AT##-##AT## Firma kostete 3,5 Mio. Euro .',
                'Der US ##AT##-##AT## Präsident sprach gestern .',
                'Es ist &quot; gut &quot; und schnell .']
  assert bleu_lib.moses_tokenize(HYPOTHESES, 'de') == [
      h.replace(' ##AT##-##AT## ', '-') for h in hypotheses]
  bleu = bleu_lib.compound_split_bleu(HYPOTHESES, REFERENCES, 'de')
  expected = sacrebleu.corpus_bleu(hypotheses, [references], tokenize='none')
  assert bleu.score == pytest.approx(expected.score)
  assert 'compound split' in bleu.label and 'tok:none' in bleu.signature
  # Splitting matters: without it the two compounds count as single (wrong) words.
  assert bleu.score != pytest.approx(sacrebleu.corpus_bleu(
      [h.replace(' ##AT##-##AT## ', '-') for h in hypotheses],
      [[r.replace(' ##AT##-##AT## ', '-') for r in references]], tokenize='none').score)


def test_tokenized_bleu_against_tokenised_references():
  references = ['die ein-mann-firma kostete 3,5 mio. euro .', 'der us-präsident sprach gestern .',
                'es ist &quot; gut &quot; und schnell .']
  plain = bleu_lib.tokenized_bleu(HYPOTHESES, references)
  assert plain.score == pytest.approx(
      sacrebleu.corpus_bleu(HYPOTHESES, [references], tokenize='none').score)
  full = bleu_lib.tokenized_bleu(HYPOTHESES, references, lowercase=True,
                                 tokenize_hypotheses=True, lang='de')
  tokenised = ['Die Ein-Mann-Firma kostet 3,5 Mio. Euro .', 'Der US-Präsident sprach .',
               'Es ist &quot; gut &quot; &amp; schnell .']
  assert full.score == pytest.approx(sacrebleu.corpus_bleu(
      tokenised, [references], tokenize='none', lowercase=True).score)
  assert full.score > plain.score
  assert 'lowercased' in full.label and 'Moses-tokenised' in full.label
  assert 'case:lc' in full.signature and 'tok:none' in full.signature


def test_exact_match_ignores_whitespace_only():
  assert bleu_lib.exact_match(['a  b', 'c'], ['a b', 'd']) == 50.0
  assert bleu_lib.exact_match([], []) == 0.0


def test_bleu_schedule_and_sentence_count_semantics():
  config = ml_collections.ConfigDict({'bleu_every': 3000, 'bleu_sentences': -1})
  assert [s for s in (1000, 2000, 3000, 4000, 6000, 6500)
          if bleu_lib.bleu_sentences_due(s, 6500, config)] == [3000, 6000, 6500]
  config.bleu_every, config.bleu_sentences = 0, 200
  assert bleu_lib.bleu_sentences_due(1000, 6500, config) == 200
  config.bleu_sentences = 0
  assert bleu_lib.bleu_sentences_due(6500, 6500, config) == 0
  # The last step decodes all, even with none while training; the others as configured.
  config.full_bleu_at_end = True
  assert bleu_lib.bleu_sentences_due(6500, 6500, config) == -1
  assert bleu_lib.bleu_sentences_due(6000, 6500, config) == 0
  config.bleu_sentences = 200
  assert bleu_lib.bleu_sentences_due(6000, 6500, config) == 200


class _CountingTranslator:
  """Echoes each source as its translation and records how many it was given."""
  beam_size, alpha = 1, 0.6

  def __init__(self):
    self.counts = []

  def translate(self, params, inputs):
    del params
    self.counts.append(len(inputs))
    return list(inputs)


def test_validation_bleu_decodes_the_subset_or_the_override():
  vocab = types.SimpleNamespace(decode=lambda ids: ' '.join(map(str, ids)))
  class Split(types.SimpleNamespace):
    def __len__(self):
      return len(self.inputs)

  split = Split(inputs=[[i, i + 1] for i in range(10)], sources=[''] * 10,
                references=[f'{i} {i + 1}' for i in range(10)])
  config = ml_collections.ConfigDict({'bleu_sentences': 3, 'bleu_tokenize': 'none',
                                      'bleu_lowercase': False})
  translator = _CountingTranslator()
  scores, _ = bleu_lib.validation_bleu(translator, None, split, vocab, config)
  assert translator.counts == [3] and scores['exact_match'] == 100.0
  bleu_lib.validation_bleu(translator, None, split, vocab, config, sentences=-1)
  bleu_lib.validation_bleu(translator, None, split, vocab, config, sentences=20)
  assert translator.counts == [3, 10, 10]


def test_best_bleu_file_keeps_the_best_step(tmp_path):
  def bleu(score):
    return bleu_lib.Bleu(score, 'sacreBLEU', 'sig')

  assert bleu_lib.record_best_bleu(str(tmp_path), 10, bleu(5.0))
  assert not bleu_lib.record_best_bleu(str(tmp_path), 20, bleu(3.0))
  assert json.load(open(tmp_path / 'best_bleu.json'))['step'] == 10
  assert bleu_lib.record_best_bleu(str(tmp_path), 30, bleu(7.5))
  assert json.load(open(tmp_path / 'best_bleu.json')) == {
      'step': 30, 'bleu': 7.5, 'label': 'sacreBLEU', 'signature': 'sig'}
