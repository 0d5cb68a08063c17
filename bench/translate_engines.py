"""translate's two engines on one input file: sentences/s of t2t_jax's compiled search and of
CTranslate2 (one compute type per process), through the path
`python -m t2t_jax.translate --engine=...` takes (trained_run.load or load_ctranslate2, then
translate_lines), interleaved in one process with a 2048^3 float32 matmul timed every round.
One JSON line per engine and search.

  python bench/translate_engines.py --workdir=/tmp/m30k \
      --input=../shared/data/multi30k/tok/valid.lc.norm.tok.en \
      --references=../shared/data/multi30k/tok/valid.lc.norm.tok.de --bleu_tokenize=none \
      --beam_sizes=1,4 --alpha=1.4 --length_penalty=length --ct2_compute_type=float32 \
      --ct2_patience=exact,1 --ct2_threads=2 --rounds=3 --t2t_jax_gnmt
  (the same with --ct2_compute_type=int8: in another process, see _with_search)

Every side translates the whole file once untimed (t2t_jax compiles its shapes then, and
CTranslate2 warms up: `first_pass_seconds`), then once per round, the sides in order on even
rounds and in reverse on odd ones; the figures are medians over the rounds. Each line says how
many outputs equal those of the t2t_jax side of its beam size, and BLEU against --references.
"""

import copy
import dataclasses
import os
import statistics
import sys
import time

from absl import app
from absl import flags
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top

from t2t_jax import cli
from t2t_jax.decoding import bleu as bleu_lib
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.deploy import trained_run

_WORKDIR = flags.DEFINE_string('workdir', None, 'The trained run to translate with.')
_CHECKPOINT = flags.DEFINE_string('checkpoint', None, 'A step or checkpoint directory; default '
                                  'the latest step.')
_INPUT = flags.DEFINE_string('input', None, 'Source sentences, one per line.')
_REFERENCES = flags.DEFINE_string('references', '', 'Their references, for BLEU.')
_BLEU_TOKENIZE = flags.DEFINE_string('bleu_tokenize', '13a', "sacreBLEU's tokenizer ('none' "
                                     'for tokenised references).')
_BEAM_SIZES = flags.DEFINE_list('beam_sizes', ['1', '4'], 'Beam sizes; 1 is greedy.')
_ALPHA = flags.DEFINE_float('alpha', None, 'Length penalty exponent; default config.eval.alpha.')
_LENGTH_PENALTY = flags.DEFINE_enum('length_penalty', 'length', ['gnmt', 'length'],
                                    "Both engines' penalty ('gnmt': t2t_jax only).")
_COMPUTE_TYPE = flags.DEFINE_string('ct2_compute_type', 'float32', "CTranslate2's compute type "
                                    '(one per process: _with_search); empty: t2t_jax alone.')
_PATIENCE = flags.DEFINE_list('ct2_patience', ['exact'], "Beam search's --ct2_patience values: "
                              "'exact' (unset: t2t_jax's outputs) or a number.")
_THREADS = flags.DEFINE_integer('ct2_threads', 0, "CTranslate2's threads; 0: its default.")
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Timed passes per side.')
_T2T_JAX_GNMT = flags.DEFINE_bool('t2t_jax_gnmt', False, "Beam search: also t2t_jax with GNMT's "
                                  'penalty, which CTranslate2 lacks (the recipe\'s).')


class _Side:
  """One engine and search over the input: its passes' seconds and outputs."""

  def __init__(self, name: str, run: trained_run.Run, lines: list[str], fields: dict):
    self.name, self.run, self.lines, self.fields = name, run, lines, fields
    self.seconds, self.texts, self.target_tokens = [], None, 0
    self.first_pass_seconds = self._pass()

  def _pass(self) -> float:
    start = time.perf_counter()
    self.texts, _, outputs = trained_run.translate_lines(self.run, self.lines)
    seconds = time.perf_counter() - start
    self.target_tokens = sum(len(ids) for ids in outputs)
    return seconds

  def timed_pass(self) -> None:
    self.seconds.append(self._pass())


def _with_search(run: trained_run.Run, beam_size: int, patience: str) -> trained_run.Run:
  """The CTranslate2 `run` searching with another beam size and --ct2_patience, on the same
  loaded model.

  One model per process: each CTranslate2 translator keeps its own threads, and after a
  second one (or an int8 one, which leaves a thread behind when deleted) had run in a process
  on this 2-core machine, every later call ran 1.4-2.7 times slower than before (float32, the
  same sentences: 4.1-4.3 s before, 11.4-11.7 s with two translators loaded; 8.8-9.7 s
  before, 13.4 s after an int8 one had run and been deleted).
  """
  translator = copy.copy(run.translator)
  translator.search = dataclasses.replace(
      translator.search, beam_size=beam_size,
      patience=None if patience == 'exact' else float(patience))
  translator.search.check()
  translator.beam_size = beam_size
  translator.stats = translator_lib.TranslateStats()
  return dataclasses.replace(run, translator=translator)


def _sides(lines: list[str], beam_size: int, ctranslate2_run) -> list[_Side]:
  common_args = dict(checkpoint=_CHECKPOINT.value, beam_size=beam_size, alpha=_ALPHA.value,
                     length_penalty=_LENGTH_PENALTY.value)
  sides = [_Side('t2t_jax', trained_run.load(_WORKDIR.value, **common_args), lines,
                 {'engine': 't2t_jax'})]
  if beam_size > 1 and _T2T_JAX_GNMT.value:
    sides.append(_Side('t2t_jax gnmt', trained_run.load(
        _WORKDIR.value, **dict(common_args, length_penalty='gnmt')), lines, {'engine': 't2t_jax'}))
  if ctranslate2_run is None:
    return sides
  for patience in _PATIENCE.value if beam_size > 1 else ['exact']:
    sides.append(_Side(f'ctranslate2 {_COMPUTE_TYPE.value} patience {patience}',
                       _with_search(ctranslate2_run, beam_size, patience), lines, {
                           'engine': 'ctranslate2', 'compute_type': _COMPUTE_TYPE.value,
                           'ct2_patience': patience, 'ct2_threads': _THREADS.value}))
  return sides


def _record(side: _Side, reference: _Side, references: list[str], matmul_rates: list[float],
            beam_size: int) -> dict:
  seconds = statistics.median(side.seconds)
  translator = side.run.translator
  record = {
      'benchmark': 'translate_engines', **side.fields, 'config': side.run.config.name,
      'alpha': translator.alpha, 'length_penalty': translator.length_penalty,
      **common.device_info(),
      'cpu_count': os.cpu_count(), 'search': 'greedy' if beam_size == 1 else 'beam',
      'beam_size': beam_size, 'input': _INPUT.value, 'sentences': len(side.lines),
      'target_tokens': side.target_tokens,
      'rounds': len(side.seconds), 'seconds': [round(s, 3) for s in side.seconds],
      'sentences_per_second_median': round(len(side.lines) / seconds, 2),
      'target_tokens_per_second_median': round(side.target_tokens / seconds, 1),
      'first_pass_seconds': round(side.first_pass_seconds, 2),
      'matmul_2048_float32_gflops_median': round(statistics.median(matmul_rates) / 1e9, 1),
      'same_output_as_t2t_jax': round(sum(a == b for a, b in zip(side.texts, reference.texts))
                                      / len(side.lines), 4)}
  if translator.engine == 't2t_jax':
    record['compile_seconds'] = round(translator.stats.compile_seconds, 2)
  if references:
    bleu = bleu_lib.sacrebleu_score(side.texts, references, _BLEU_TOKENIZE.value)
    record.update(bleu=round(bleu.score, 2), bleu_label=bleu.label, bleu_signature=bleu.signature)
  return record


def _read(path: str) -> list[str]:
  with open(path, encoding='utf-8') as f:
    return f.read().splitlines()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not _WORKDIR.value or not _INPUT.value:
    raise app.UsageError('--workdir and --input are required')
  lines = _read(_INPUT.value)
  references = _read(_REFERENCES.value) if _REFERENCES.value else []
  matmul = common.Matmul(2048, jnp.float32)
  ctranslate2_run = trained_run.load_ctranslate2(
      _WORKDIR.value, _CHECKPOINT.value, beam_size=1, alpha=_ALPHA.value,
      length_penalty=_LENGTH_PENALTY.value, compute_type=_COMPUTE_TYPE.value,
      threads=_THREADS.value) if _COMPUTE_TYPE.value else None
  for beam_size in map(int, _BEAM_SIZES.value):
    sides = _sides(lines, beam_size, ctranslate2_run)
    matmul_rates = []
    for round_index in range(_ROUNDS.value):
      for side in sides if round_index % 2 == 0 else sides[::-1]:
        side.timed_pass()
      matmul_rates.append(matmul.flops_per_second())
      print(f'beam {beam_size} round {round_index}: ' + ', '.join(
          f'{side.name} {side.seconds[-1]:.2f} s' for side in sides) +
            f', matmul {matmul_rates[-1] / 1e9:.1f} GFLOP/s', file=sys.stderr, flush=True)
    for side in sides:
      print(cli.json_line(_record(side, sides[0], references, matmul_rates, beam_size)),
            flush=True)


if __name__ == '__main__':
  cli.run(main, compilation_cache=None)  # Timed compiles stay fresh.
