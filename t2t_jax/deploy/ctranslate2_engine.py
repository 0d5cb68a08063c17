"""translate and evaluate with --engine=ctranslate2: t2t_jax's sentences, output limits and
outputs, the search run by CTranslate2 on the checkpoint exported to the run's workdir.

  python -m t2t_jax.translate --engine=ctranslate2 --workdir=/tmp/m30 --input=src.txt \
      --output=out.txt
  python -m t2t_jax.translate --engine=ctranslate2 --ct2_compute_type=int8 --beam_size=4 \
      --length_penalty=length --workdir=/tmp/m30 --input=src.txt

The export is cached in `<workdir>/ctranslate2/<name>`, one float32 model per checkpoint
(`step_<N>` for a step of the run, else the checkpoint directory's name and a hash of its
path; `_ema` added for the moving average of the weights); CTranslate2 converts it to the
compute type as it loads it. A model directory is there whole or not at all: the export is
written into a `.partial-<host>-<pid>-*` directory beside it and renamed into place once
complete, and an export removes the partial directories that processes of this host no
longer running left behind. `source.json` in the model directory records what it was exported
from (the checkpoint's files with their sizes and modification times, the model config, the
vocabulary's digest); a model whose source has changed is exported again.
"""

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
import time
from typing import Callable, Sequence

from absl import logging
import numpy as np

from t2t_jax import ConfigError
from t2t_jax import EOS_ID
from t2t_jax import workdir_lock
from t2t_jax import workdir_layout
from t2t_jax.checkpoints import saved_params
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.decoding.decode import max_decode_length
from t2t_jax.deploy import export_ctranslate2
from t2t_jax.deploy import optional
from t2t_jax.model.model_config import TransformerConfig

SOURCE_FILE = 'source.json'  # In each model directory: what it was exported from.
PARTIAL_STEM = '.partial'  # An export being written: workdir_lock.scratch_prefix's stem.
# Compute types CTranslate2 can load a model in; which of them a CPU runs,
# ctranslate2.get_supported_compute_types('cpu') says ('float32', 'int8', 'int8_float32' here).
COMPUTE_TYPES = ('default', 'auto', 'float32', 'int8', 'int8_float32', 'int8_float16',
                 'int8_bfloat16', 'int16', 'float16', 'bfloat16')


def _ctranslate2():
  return optional.import_needing_ctranslate2('ctranslate2', '--engine=ctranslate2')


# The cache of exported models.


def model_name(workdir: str, checkpoint_path: str, weights: str = 'params') -> str:
  """The cache entry's name of a checkpoint: `step_<N>` for the run's own steps."""
  checkpoint_path = os.path.abspath(checkpoint_path)
  parent, base = os.path.split(os.path.normpath(checkpoint_path))
  if base.isdigit() and parent == workdir_layout.checkpoints_dir(workdir):
    name = f'step_{base}'
  else:
    name = f'{base}_{hashlib.sha256(checkpoint_path.encode()).hexdigest()[:8]}'
  return name + ('_ema' if weights == 'ema' else '')


def _digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def export_source(config, vocab, checkpoint_path: str, weights: str) -> dict:
  """What an export of the checkpoint depends on: a rewritten checkpoint (its files' sizes or
  modification times), another model config or vocabulary gives another record."""
  files = []
  for directory, subdirectories, names in os.walk(checkpoint_path):
    subdirectories.sort()
    for name in sorted(names):
      path = os.path.join(directory, name)
      stat = os.stat(path)
      files.append([os.path.relpath(path, checkpoint_path), stat.st_size, stat.st_mtime_ns])
  return {'checkpoint': os.path.abspath(checkpoint_path), 'weights': weights,
          'checkpoint_files': _digest(files), 'model_config': _digest(config.model.to_dict()),
          'vocabulary': _digest([vocab.piece(i) for i in range(vocab.vocab_size)])}


def _recorded_source(model_dir: str) -> dict | None:
  try:
    with open(os.path.join(model_dir, SOURCE_FILE)) as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def exported_model(config, vocab, workdir: str, checkpoint: str | None = None,
                   weights: str = 'params') -> tuple[str, bool]:
  """The cached CTranslate2 model of a checkpoint (default the latest), exported first when
  absent or out of date; returns its directory and whether it was exported now."""
  checkpoint_path = saved_params.checkpoint_path(workdir, checkpoint)
  cache = workdir_layout.ctranslate2_dir(workdir)
  model_dir = os.path.join(cache, model_name(workdir, checkpoint_path, weights))
  source = export_source(config, vocab, checkpoint_path, weights)
  if _recorded_source(model_dir) == source:
    return model_dir, False
  os.makedirs(cache, exist_ok=True)
  workdir_lock.remove_dead_scratch(cache, PARTIAL_STEM)  # Exports of processes that died.
  partial = tempfile.mkdtemp(prefix=workdir_lock.scratch_prefix(PARTIAL_STEM), dir=cache)
  try:
    written = optional.export_ctranslate2(workdir, checkpoint_path,
                                        os.path.join(partial, 'model'), weights=weights)
    with open(os.path.join(written, SOURCE_FILE), 'w') as f:
      json.dump(source, f, indent=1)
    if os.path.exists(model_dir):  # Out of date: moved aside, removed with the partial dir.
      os.rename(model_dir, os.path.join(partial, 'replaced'))
    try:
      os.rename(written, model_dir)
    except OSError:  # Another process put its export there first.
      if _recorded_source(model_dir) != source:
        raise
  finally:
    shutil.rmtree(partial, ignore_errors=True)
  return model_dir, True


# The search.


@dataclasses.dataclass(frozen=True)
class Decoding:
  """The search CTranslate2 runs: beam size 1 is greedy search; beam scores are divided by
  length ** alpha ('length'; GNMT's ((5 + length) / 6) ** alpha only at alpha 0, where both
  are 1). `patience` None stops a sentence where t2t_jax's search would give the same output
  (below); a number is CTranslate2's own stop, once patience x beam hypotheses have finished."""
  beam_size: int = 1
  alpha: float = 0.6
  length_penalty: str = 'gnmt'
  patience: float | None = None

  def check(self) -> None:
    """Refuses what CTranslate2 cannot search."""
    if self.beam_size < 1:
      raise ConfigError(f'beam size must be at least 1, got {self.beam_size}')
    if self.patience is not None and self.patience <= 0:
      raise ConfigError(f'--ct2_patience={self.patience} must be above 0')
    if self.beam_size > 1 and self.alpha != 0 and self.length_penalty == 'gnmt':
      raise ConfigError(
          f"--engine=ctranslate2 cannot run beam search (beam {self.beam_size}) with GNMT's "
          f"length penalty ((5 + length) / 6)^alpha (length penalty 'gnmt', alpha "
          f'{self.alpha}): CTranslate2 divides by length^alpha. Pass --length_penalty=length '
          'for that penalty (--engine=t2t_jax computes it too), --alpha=0 for none, or '
          '--beam_size=1 (greedy)')

  def options(self, limit: int) -> dict:
    """translate_batch's search arguments for outputs of at most `limit` tokens.

    Both engines keep 2W candidates a step and finish an EOS among the best W. t2t_jax stops
    a sentence once no live hypothesis can beat its W finished ones; CTranslate2 has no such
    test: at alpha 0 it stops when the best candidate is an EOS (the same outcome), else once
    patience x W hypotheses have finished, which can be before a better, longer one does. A
    patience of `limit` (never reached before the last step) searches on to the limit, and
    returns what t2t_jax's search returns.
    """
    penalty = self.alpha if self.length_penalty == 'length' else 0.0
    patience = self.patience
    if patience is None:
      patience = float(limit) if self.beam_size > 1 and penalty != 0 else 1.0
    return dict(beam_size=self.beam_size, length_penalty=penalty, patience=patience,
                max_decoding_length=limit, min_decoding_length=0)  # t2t_jax may end at once.


class Translator:
  """translator.Translator's interface (translate, stats, beam_size, alpha, length_penalty)
  over a CTranslate2 model: same inputs (ids ending in EOS), same outputs (ids, EOS included
  where one was generated), same per-sentence output limits. An encoder-decoder model runs in
  ctranslate2.Translator; a decoder-only one (causal prefix attention, the only kind the export
  writes) in ctranslate2.Generator, prompted with the source, EOS and the start token
  (ctranslate2_decoder_only.prompt), its output limit t2t_jax's (the source's positions come
  first).

  Each call to CTranslate2 is one batch of sentences of similar length, at most
  `batch_tokens` padded source tokens over all beams, as t2t_jax's batches count them (`_calls`);
  each output is at most its source length + `max_extra_len` tokens (capped by the model's
  max_len). Greedy search is t2t_jax's (the export keeps PAD out of the softmax, and greedy
  search never picks PAD anyway); so is beam search with `search.patience` None, up to the
  scores' share of PAD and rounding (`Decoding.options`).
  """

  engine = 'ctranslate2'

  def __init__(self, model_dir: str, vocab, model_config: TransformerConfig, batch_tokens: int,
               max_extra_len: int, search: Decoding = Decoding(), compute_type: str = 'float32',
               threads: int = 0):
    search.check()
    ctranslate2 = _ctranslate2()
    if compute_type not in COMPUTE_TYPES:
      raise ConfigError(f'--ct2_compute_type={compute_type!r} must be one of {COMPUTE_TYPES}')
    start = time.perf_counter()
    self.decoder_only = model_config.kind == 'decoder_only'
    engine = ctranslate2.Generator if self.decoder_only else ctranslate2.Translator
    try:
      self._model = engine(model_dir, device='cpu', compute_type=compute_type, inter_threads=1,
                           intra_threads=threads)
    except ValueError as e:  # A compute type this CPU does not run.
      supported = sorted(ctranslate2.get_supported_compute_types('cpu'))
      raise ConfigError(f'--ct2_compute_type={compute_type}: {e} (this CPU runs '
                        f'{supported})') from None
    self.load_seconds = time.perf_counter() - start
    self.model_dir, self.compute_type, self.threads = model_dir, compute_type, threads
    self.config, self.batch_tokens, self.max_extra_len = model_config, batch_tokens, max_extra_len
    self.search = search
    self.beam_size, self.alpha = search.beam_size, search.alpha
    self.length_penalty = search.length_penalty
    self._pieces = [vocab.piece(i) for i in range(vocab.vocab_size)]
    self._ids = {piece: i for i, piece in enumerate(self._pieces)}
    self.stats = translator_lib.TranslateStats()
    self.exported, self.export_seconds = False, 0.0  # Set by `from_config`.

  def _limit(self, length: int) -> int:
    return max_decode_length(length, self.max_extra_len, self.config.max_len, self.decoder_only)

  def _search(self, sources: list[list[str]], limit: int) -> list[list[str]]:
    """The best output pieces of each source (EOS kept where generated), at most `limit`."""
    options = dict(self.search.options(limit),
                   return_end_token=True)  # Outputs keep EOS, as t2t_jax's do.
    if self.decoder_only:
      from t2t_jax.deploy import ctranslate2_decoder_only  # pylint: disable=g-import-not-at-top
      options['max_length'] = options.pop('max_decoding_length')
      options['min_length'] = options.pop('min_decoding_length')
      results = self._model.generate_batch(
          [ctranslate2_decoder_only.prompt(source, self._pieces) for source in sources],
          include_prompt_in_result=False, **options)
      return [result.sequences[0] for result in results]
    results = self._model.translate_batch(
        sources, max_input_length=0,  # Sources arrive cut to the model's length already.
        **options)
    return [result.hypotheses[0] for result in results]

  def _calls(self, lengths: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(output limit, input indices) of each translate_batch call, shortest sources first,
    each at most `batch_tokens` padded source tokens over the beams (one CTranslate2 batch).

    CTranslate2 takes one output limit per call. A beam search call holds sentences of one
    limit (where hypotheses are cut decides which wins); so does a decoder-only model's call,
    since its outputs' positions follow the source's and a shorter source's longer limit would
    run a longer one past the position table. An encoder-decoder model's greedy call holds
    any, with the longest limit, its outputs then cut to their own (greedy tokens do not depend
    on the limit).
    """
    limits = {i: self._limit(n) for i, n in enumerate(lengths) if n}
    one_limit = self.beam_size > 1 or self.decoder_only
    group = (lambda i: limits[i]) if one_limit else (lambda i: 0)
    calls, members = [], []
    for index in sorted(limits, key=lambda i: (group(i), lengths[i])):
      grown = members + [index]
      if members and (group(index) != group(members[0]) or len(grown) * lengths[index] *
                      self.beam_size > self.batch_tokens):
        calls.append((max(limits[i] for i in members), members))
        grown = [index]
      members = grown
    if members:
      calls.append((max(limits[i] for i in members), members))
    return calls

  def translate(self, params, inputs: Sequence[np.ndarray],
                progress: Callable[[int], object] | None = None) -> list[np.ndarray]:
    """Output ids of each input, in order; [] for an empty input. `params` is unused (the
    model is CTranslate2's): the argument keeps translator.Translator's signature."""
    del params
    start = time.perf_counter()
    translator_lib.check_input_lengths(inputs, self.config)
    lengths = [len(ids) for ids in inputs]
    outputs = [np.zeros((0,), np.int32)] * len(inputs)
    for limit, members in self._calls(lengths):
      sources = [[self._pieces[i] for i in _without_eos(inputs[index])] for index in members]
      search_start = time.perf_counter()
      results = self._search(sources, limit)
      self.stats.search_seconds += time.perf_counter() - search_start
      self.stats.batches += 1
      for index, pieces in zip(members, results):
        outputs[index] = np.asarray([self._ids[p] for p in pieces[:self._limit(lengths[index])]],
                                    np.int32)
      if progress:
        progress(len(members))
    empty = lengths.count(0)
    if progress and empty:
      progress(empty)
    self.stats.sentences += len(inputs)
    self.stats.seconds += time.perf_counter() - start
    return outputs


def _without_eos(ids) -> list[int]:
  """A source as CTranslate2 takes it: the export has it append EOS itself."""
  ids = [int(i) for i in ids]
  return ids[:-1] if ids and ids[-1] == EOS_ID else ids


def from_config(config, model_config: TransformerConfig, vocab, workdir: str,
                checkpoint: str | None = None, weights: str = 'params',
                beam_size: int | None = None, alpha: float | None = None,
                batch_tokens: int | None = None, length_penalty: str | None = None,
                patience: float | None = None, compute_type: str = 'float32',
                threads: int = 0) -> Translator:
  """The CTranslate2 translator of a run's checkpoint, decoding as its config.eval asks; the
  arguments given override the config's values. Exports the checkpoint first if its cached
  model is absent or out of date."""
  search = Decoding(config.eval.beam_size if beam_size is None else beam_size,
                  config.eval.alpha if alpha is None else alpha,
                  config.eval.length_penalty if length_penalty is None else length_penalty,
                  patience)
  search.check()  # Before any work,
  export_ctranslate2.check_exportable(model_config)  # as is a model the export refuses.
  start = time.perf_counter()
  model_dir, exported = exported_model(config, vocab, workdir, checkpoint, weights)
  export_seconds = time.perf_counter() - start
  logging.info('%s CTranslate2 model %s%s', 'Exported' if exported else 'Reusing the',
               model_dir, f' in {export_seconds:.1f} s' if exported else '')
  translator = Translator(
      model_dir, vocab, model_config,
      config.data.batch_tokens if batch_tokens is None else batch_tokens,
      config.eval.max_extra_len, search, compute_type, threads)
  translator.exported, translator.export_seconds = exported, export_seconds
  return translator
