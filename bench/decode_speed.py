"""Decoding speed: greedy and beam search, three ways. One JSON line per measurement.

  python bench/decode_speed.py --mode=reference                  # beside Flax's WMT example
  python bench/decode_speed.py --mode=text --num_sentences=3000  # the translate path, real text
  python bench/decode_speed.py --mode=random --config=configs/default.py

--mode=reference: t2t_jax's jitted search and the reference's (Flax's examples/wmt
predict_step, imported from --reference_dir, never copied) on the same shape, interleaved in
one process (A, B, then B, A, ...), with a 2048^3 float32 matmul timed every round. The
default shape is ../shared/anchor/side_by_side.py's decode bench: bench/common.py's `small`
dims (vocab 8000, d_model 256, FFN 1024, 3+3 layers, 4 heads), pre-LN, 32 random sources of 32
tokens, random weights. Equal work by construction: both emit --output_length tokens per
hypothesis (random weights end no hypothesis early; the work check in the output says so).
Greedy runs against the reference's beam 1. With --profile, a third side joins the rounds,
the matmul floor (bench/floor.py: the matrix products any search of the batch must do, and
nothing else: the encoder and the cross-attention keys/values once, step i's self-attention
over i + 1 positions, the W beams of a sentence sharing its cross-attention keys/values;
`floor_flops` its work). The reference's time over the floor's is `ratio_ceiling_median`, and
each side's `over_floor_median` is its time over the floor's (per round, the median); each
side's line also says where one traced call's time goes: seconds in matrix products (XLA's
library fusions and dots) against other ops, and the costliest op kinds.

--mode=text: the `python -m t2t_jax.translate` path (trained_run.load, translate_lines) on the
first --num_sentences lines of --sentences (repeated if short), with a model of --config's
dims (default: the paper's base), random weights, and a SentencePiece vocabulary trained on
that text, in a temporary run directory. Random weights rarely emit EOS, so every output
runs to its length limit (source + --max_extra_len tokens): target tokens/s is the figure to
compare; sentences/s is that of outputs longer than a trained model's.

With --ctranslate2=float32,int8 text mode also exports the same parameters to CTranslate2
(t2t_jax/deploy/export_ctranslate2.py) and translates the same sentences with it, once per compute
type and beam size, printing sentences/s beside BLEU against t2t_jax's own outputs (and against
--references when given). CTranslate2 gets the same pieces (EOS appended by the model), the same
per-sentence output limit (it is called once per limit) and --ctranslate2_threads threads; its
length penalty is length^alpha where t2t_jax's is ((5 + length) / 6)^alpha, so beam outputs
may differ at alpha > 0 (greedy ones should not).

--mode=random: the Translator on random ids whose lengths follow --sentences, with --config's
model, its batch_tokens and its max_extra_len.
"""

import functools
import math
import os
import statistics
import sys
import tempfile
import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top
import flax_reference  # pylint: disable=g-import-not-at-top
import floor  # pylint: disable=g-import-not-at-top

from t2t_jax import cli
from t2t_jax import EOS_ID
from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import pipeline as data
from t2t_jax.data import tokenizer
from t2t_jax.decoding import decode
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.deploy import trained_run
from t2t_jax.model.transformer import Transformer, TransformerConfig
from t2t_jax.training import build as setup_lib
from t2t_jax.training import train

_MODE = flags.DEFINE_enum('mode', 'reference', ['reference', 'text', 'random'],
                          'What to measure (module docstring).')
_CONFIG = config_flags.DEFINE_config_file(
    'config', 'configs/wmt14_ende.py:base', 'text/random: the model (and for random its '
    'batching) to measure.')
_SENTENCES = flags.DEFINE_string('sentences', '../shared/data/wmt-sample/train.en',
                                 'text: the source text; random: its line lengths.')
_NUM_SENTENCES = flags.DEFINE_integer('num_sentences', 3000, 'text/random: sentences decoded.')
_BEAM_SIZES = flags.DEFINE_list('beam_sizes', ['1', '4'], 'Beam sizes to measure; 1 is greedy.')
_ALPHA = flags.DEFINE_float('alpha', 0.6, 'Length penalty exponent.')
_BATCH_TOKENS = flags.DEFINE_list('batch_tokens', ['4096'],
                                  'text: --batch_tokens values of translate to measure.')
_MAX_EXTRA_LEN = flags.DEFINE_integer('max_extra_len', 50, 'text: output = source + this.')
_VOCAB_SIZE = flags.DEFINE_integer('vocab_size', 8000, 'text: SentencePiece vocabulary size.')
_DTYPE = flags.DEFINE_enum('dtype', 'auto', list(translator_lib.DECODE_DTYPES), 'text: eval.dtype.')
_CTRANSLATE2 = flags.DEFINE_list('ctranslate2', [], 'text: CTranslate2 compute types to '
                                 'measure beside t2t_jax (e.g. float32,int8); none by default.')
_CTRANSLATE2_THREADS = flags.DEFINE_integer('ctranslate2_threads', 0, 'text: CTranslate2 '
                                            'intra_threads; 0: all cores.')
_REFERENCES = flags.DEFINE_string('references', '', 'text: reference translations of '
                                  '--sentences (line for line) for a BLEU against them.')
_REPEATS = flags.DEFINE_integer('repeats', 1, 'text/random: timed passes (median).')
_SHAPE = flags.DEFINE_enum('shape', 'small', sorted(common.SHAPES), 'reference: model dims.')
_SOURCES = flags.DEFINE_integer('sources', 32, 'reference: sentences per batch.')
_SOURCE_LENGTH = flags.DEFINE_integer('source_length', 32, 'reference: tokens per source.')
_OUTPUT_LENGTH = flags.DEFINE_integer('output_length', 40, 'reference: tokens per output.')
_ROUNDS = flags.DEFINE_integer('rounds', 5, 'reference: interleaved rounds.')
_PROFILE = flags.DEFINE_bool('profile', False, 'reference: after the rounds, trace one call '
                             'of each side and report where its time goes (op kinds, matmuls).')
_REFERENCE_DIR = flags.DEFINE_string('reference_dir', '../shared/anchor/flax_wmt',
                                     "reference: Flax's examples/wmt, relative to the cwd.")


def _output_tokens(outputs) -> int:
  """Generated tokens, EOS included, of every output."""
  total = 0
  for ids in outputs:
    ids = list(ids)
    total += ids.index(EOS_ID) + 1 if EOS_ID in ids else len(ids)
  return total


def _random_params(model_config: TransformerConfig, mesh, axis_rules):
  abstract = setup_lib.abstract_params(model_config, mesh, axis_rules)
  tokens = jnp.ones((1, 1), jnp.int32)
  init = jax.jit(lambda: nn.meta.unbox(Transformer(model_config).init(
      jax.random.PRNGKey(0), tokens, tokens)['params']),
                 out_shardings=jax.tree.map(lambda s: s.sharding, abstract))
  with sharding.mesh_context(mesh, axis_rules):
    return init()


# --mode=reference


class _Search:
  """One side's compiled search on the shared batch; calling it blocks until done."""

  def __init__(self, name: str, run, flops_source):
    self.name, self.run = name, run
    start = time.perf_counter()
    self.output = run()
    self.first_call_seconds = time.perf_counter() - start
    self.xla_flops = common.xla_flops(flops_source())

  def __call__(self):
    return self.run()


def t2t_search(shape, sources, beam_size: int, steps: int, alpha: float,
               dtype: str = 'float32') -> _Search:
  """t2t_jax's jitted search (greedy at beam 1) of a random-weight `shape` model on `sources`,
  compiled and run once; bench/accelerator.py reuses it."""
  config = common.t2t_config(shape, dict(dropout=0.0, attention_dropout=0.0, relu_dropout=0.0),
                             dtype=dtype)
  setup = train.build(config, shape.vocab, sharding.make_mesh(config.mesh, jax.devices()[:1]))
  params = setup.init(jax.random.PRNGKey(0)).params
  if beam_size == 1:
    search = functools.partial(decode.greedy_search, config=setup.model_config, max_len=steps)
  else:
    search = functools.partial(decode.beam_search, config=setup.model_config, max_len=steps,
                               beam_size=beam_size, alpha=alpha)
  jitted = runtime.jit_search(search)  # As Translator's.
  inputs = jnp.asarray(sources)

  def run():
    with sharding.mesh_context(setup.mesh, setup.axis_rules):
      return jax.block_until_ready(jitted(params, inputs))

  def lowered():
    with sharding.mesh_context(setup.mesh, setup.axis_rules):
      return jitted.lower(params, inputs).compile()
  return _Search('t2t_jax', run, lowered)


def _reference_search(reference, shape, sources, beam_size: int, steps: int) -> _Search:
  model_config = reference.models.TransformerConfig(
      vocab_size=shape.vocab, output_vocab_size=shape.vocab, share_embeddings=True,
      logits_via_embedding=True, emb_dim=shape.d_model, num_heads=shape.heads,
      num_layers=shape.layers, qkv_dim=shape.d_model, mlp_dim=shape.d_ff, max_len=256,
      dropout_rate=0.0, attention_dropout_rate=0.0, deterministic=True, decode=False)
  params = jax.jit(reference.models.Transformer(model_config).init)(
      jax.random.PRNGKey(0), jnp.ones(sources.shape, jnp.float32),
      jnp.ones(sources.shape, jnp.float32))['params']
  decode_config = model_config.replace(decode=True)
  # Its loop runs max_decode_len - 1 decoder steps (slot 0 holds the start token).
  init_cache = jax.jit(functools.partial(reference.train.initialize_cache,
                                         max_decode_len=steps + 1, config=decode_config))
  predict = jax.jit(functools.partial(reference.train.predict_step, config=decode_config,
                                      beam_size=beam_size), static_argnums=(3, 4))
  inputs = jnp.asarray(sources)
  eos = reference.decode.EOS_ID

  def run():
    return jax.block_until_ready(predict(inputs, params, init_cache(inputs), eos, steps + 1))
  return _Search('reference', run,
                 lambda: predict.lower(inputs, params, init_cache(inputs), eos,
                                       steps + 1).compile())


def _matmul_floor(shape, sentences: int, beam_size: int, source_length: int,
                  steps: int) -> _Search:
  search_floor, x = floor.search_floor(shape, sentences, beam_size, source_length, steps)
  return _Search('matmul_floor', lambda: jax.block_until_ready(search_floor(x)),
                 lambda: search_floor.lower(x).compile())


def _reference_line(reference, beam_size: int, matmul: common.Matmul) -> dict:
  shape, steps = common.SHAPES[_SHAPE.value], _OUTPUT_LENGTH.value
  rng = np.random.default_rng(0)
  sources = rng.integers(3, shape.vocab, (_SOURCES.value, _SOURCE_LENGTH.value)).astype(np.int32)
  sides = [t2t_search(shape, sources, beam_size, steps, _ALPHA.value),
           _reference_search(reference, shape, sources, beam_size, steps)]
  if _PROFILE.value:
    sides.append(_matmul_floor(shape, sources.shape[0], beam_size, sources.shape[1], steps))
  t2t_tokens = np.asarray(sides[0].output[0] if beam_size > 1 else sides[0].output)
  best_t2t = t2t_tokens[:, 0] if beam_size > 1 else t2t_tokens
  best_reference = np.asarray(sides[1].output)
  # Without EOS neither search can stop early: both run all `steps` steps. (The reference
  # may emit PAD, id 0, as a token; t2t_jax never does, so its outputs are all non-PAD.)
  work_check = {
      't2t_jax_output_tokens_mean': float((best_t2t != 0).sum(-1).mean()),
      'reference_output_shape': list(best_reference.shape),
      't2t_jax_any_eos': bool((t2t_tokens == EOS_ID).any()),
      'reference_any_eos': bool((best_reference == reference.decode.EOS_ID).any())}
  seconds = {side.name: [] for side in sides}
  matmul_rates = []
  for round_index in range(_ROUNDS.value):
    for side in sides if round_index % 2 == 0 else sides[::-1]:
      start = time.perf_counter()
      side()
      seconds[side.name].append(time.perf_counter() - start)
    matmul_rates.append(matmul.flops_per_second())
    print(f'beam {beam_size} round {round_index}: t2t_jax {seconds["t2t_jax"][-1]:.3f}s, '
          f'reference {seconds["reference"][-1]:.3f}s, matmul '
          f'{matmul_rates[-1] / 1e9:.1f} GFLOP/s', file=sys.stderr, flush=True)
  ratios = [r / t for t, r in zip(seconds['t2t_jax'], seconds['reference'])]
  ceiling = {}
  if _PROFILE.value:  # The fastest any search doing this work could be, against the reference.
    ceilings = [r / f for f, r in zip(seconds['matmul_floor'], seconds['reference'])]
    ceiling = {'ratio_ceiling_median': round(statistics.median(ceilings), 3),
               'floor_flops': floor.floor_flops(shape, sources.shape[0], beam_size,
                                                sources.shape[1], steps)}
  sentences = sources.shape[0]
  return {
      'benchmark': 'decode', 'mode': 'reference', 'shape': _SHAPE.value,
      **common.device_info(), 'device_count': 1,
      'search': 'greedy' if beam_size == 1 else 'beam', 'beam_size': beam_size,
      'reference_beam_size': beam_size, 'alpha': _ALPHA.value, 'sentences': sentences,
      'source_length': sources.shape[1], 'output_length': steps, 'work_check': work_check,
      'rounds': _ROUNDS.value, 'ratio_per_round': [round(r, 3) for r in ratios],
      'ratio_median': round(statistics.median(ratios), 3),
      'ratio_min': round(min(ratios), 3), 'ratio_max': round(max(ratios), 3), **ceiling,
      'matmul_flops_per_second_median': statistics.median(matmul_rates),
      **{side.name: {
          'seconds': [round(s, 4) for s in seconds[side.name]],
          'sentences_per_second': round(sentences / statistics.median(seconds[side.name]), 2),
          'xla_flops': side.xla_flops,  # A while loop's body counts once.
          'first_call_seconds': round(side.first_call_seconds, 2),
          **({'over_floor_median': round(statistics.median(
              [s / f for s, f in zip(seconds[side.name], seconds['matmul_floor'])]), 3)}
             if _PROFILE.value else {}),
          **({'profile': common.op_profile(side)} if _PROFILE.value else {})}
         for side in sides},
  }


# --mode=text


def _text_run(directory: str, config, lines: list[str], batch_tokens: int) -> trained_run.Run:
  """A run directory trained_run.load reads: config, SentencePiece vocab, random-weight params."""
  config = config.copy_and_resolve_references()
  config.data.source, config.data.vocab_size = 'text', _VOCAB_SIZE.value
  config.data.batch_tokens, config.eval.max_extra_len = batch_tokens, _MAX_EXTRA_LEN.value
  config.eval.alpha, config.eval.dtype = _ALPHA.value, _DTYPE.value
  config.mesh.shape = (-1, 1, 1)
  vocab_path = data.vocab_path(config, directory)
  if not os.path.exists(vocab_path):
    tokenizer.train_sentencepiece(lines, vocab_path, _VOCAB_SIZE.value,
                                  config.data.vocab_type)
  with open(os.path.join(directory, 'config.json'), 'w') as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  params_dir = os.path.join(directory, 'random_params')
  if not os.path.exists(params_dir):
    mesh = sharding.make_mesh(config.mesh)
    model_config = TransformerConfig.from_config(config.model, _VOCAB_SIZE.value,
                                                 jax.devices()[0].platform)
    params = _random_params(model_config, mesh, sharding.rules(config.mesh))
    saved_params.write_params(params_dir, params, config.to_json_best_effort(),
                            {'kind': 'random', 'source': 'bench/decode_speed.py'})
  return trained_run.load(directory, params_dir)


def _text_lines(run: trained_run.Run, lines: list[str], beam_size: int,
                batch_tokens: int) -> tuple[dict, list[str]]:
  """The measurement, and the translations of the median pass."""
  passes = []
  for _ in range(max(1, _REPEATS.value)):
    run.translator.stats = translator_lib.TranslateStats()
    start = time.perf_counter()
    texts, inputs, outputs = trained_run.translate_lines(run, lines)
    passes.append((time.perf_counter() - start, run.translator.stats, outputs, inputs, texts))
    run.translator._compiled.clear()  # pylint: disable=protected-access  # Each pass compiles.
  seconds, stats, outputs, inputs, texts = sorted(passes, key=lambda p: p[0])[len(passes) // 2]
  target_tokens = _output_tokens(outputs)
  outside = seconds - stats.search_seconds
  return {
      'benchmark': 'decode', 'mode': 'text', 'engine': 't2t_jax', 'config': run.config.name,
      **common.device_info(), 'search': 'greedy' if beam_size == 1 else 'beam',
      'beam_size': beam_size, 'alpha': _ALPHA.value, 'batch_tokens': batch_tokens,
      'dtype': jnp.dtype(run.translator.config.dtype).name,
      'params': sum(x.size for x in jax.tree.leaves(run.params)),
      'sentences': len(lines), 'source_tokens': int(sum(len(i) for i in inputs)),
      'target_tokens': target_tokens, 'max_extra_len': _MAX_EXTRA_LEN.value,
      'seconds': round(seconds, 2),
      'sentences_per_second': round(len(lines) / seconds, 2),
      'target_tokens_per_second': round(target_tokens / seconds, 1),
      'outside_search_share': round(outside / seconds, 3),
      'search_only': {
          'sentences_per_second': round(len(lines) / stats.search_seconds, 2),
          'target_tokens_per_second': round(target_tokens / stats.search_seconds, 1)},
      **stats.as_dict(), 'seconds_total': round(seconds, 2)}, texts


def _ctranslate2_line(run: trained_run.Run, directory: str, lines: list[str], beam_size: int,
                      compute_type: str, t2t_texts: list[str], references: list[str]) -> dict:
  """CTranslate2 on the exported parameters of `run`, on the same sentences."""
  import ctranslate2  # pylint: disable=g-import-not-at-top  # Optional: only with --ctranslate2.
  import sacrebleu  # pylint: disable=g-import-not-at-top
  from t2t_jax.deploy import export_ctranslate2  # pylint: disable=g-import-not-at-top
  model_dir = os.path.join(directory, 'ctranslate2')
  if not os.path.exists(model_dir):
    export_ctranslate2.export(directory, os.path.join(directory, 'random_params'), model_dir)
  threads = _CTRANSLATE2_THREADS.value or os.cpu_count() or 1
  translator = ctranslate2.Translator(model_dir, device='cpu', compute_type=compute_type,
                                      inter_threads=1, intra_threads=threads)
  max_tokens = min(run.config.data.max_len, run.model_config.max_len)
  pieces = [[run.vocab.piece(i) for i in ids[:max_tokens - 1]]
            for ids in run.vocab.encode(lines)]
  ids_of = {run.vocab.piece(i): i for i in range(run.vocab.vocab_size)}
  by_limit = {}  # t2t_jax's per-sentence limit: source + EOS + max_extra_len, capped.
  for index, source in enumerate(pieces):
    limit = decode.max_decode_length(len(source) + 1, _MAX_EXTRA_LEN.value,
                                     run.model_config.max_len)
    by_limit.setdefault(limit, []).append(index)
  outputs = [None] * len(lines)
  start = time.perf_counter()
  for limit, members in sorted(by_limit.items()):
    results = translator.translate_batch(
        [pieces[i] for i in members], beam_size=beam_size, length_penalty=_ALPHA.value,
        max_decoding_length=limit, min_decoding_length=0,
        max_batch_size=int(_BATCH_TOKENS.value[0]) // max(1, beam_size), batch_type='tokens')
    for index, result in zip(members, results):
      outputs[index] = result.hypotheses[0]
  seconds = time.perf_counter() - start
  texts = [run.vocab.decode([ids_of[p] for p in output]) for output in outputs]
  target_tokens = sum(len(o) + (len(o) < limit) for o, limit in zip(
      outputs, [decode.max_decode_length(len(p) + 1, _MAX_EXTRA_LEN.value,
                                         run.model_config.max_len) for p in pieces]))
  bleu = {'bleu_vs_t2t_jax': round(sacrebleu.corpus_bleu(texts, [t2t_texts]).score, 2),
          'same_output_share': round(sum(a == b for a, b in zip(texts, t2t_texts)) /
                                     len(texts), 4)}
  if references:
    bleu['bleu_vs_references'] = round(sacrebleu.corpus_bleu(texts, [references]).score, 2)
  return {
      'benchmark': 'decode', 'mode': 'text', 'engine': 'ctranslate2',
      'ctranslate2_version': ctranslate2.__version__, 'compute_type': compute_type,
      'intra_threads': threads, 'config': run.config.name, **common.device_info(),
      'search': 'greedy' if beam_size == 1 else 'beam', 'beam_size': beam_size,
      'alpha': _ALPHA.value, 'length_penalty': 'length^alpha (t2t_jax: ((5+length)/6)^alpha)',
      'sentences': len(lines), 'target_tokens': target_tokens,
      'max_extra_len': _MAX_EXTRA_LEN.value, 'seconds': round(seconds, 2),
      'sentences_per_second': round(len(lines) / seconds, 2),
      'target_tokens_per_second': round(target_tokens / seconds, 1), **bleu}


def _read_lines(path: str, count: int) -> list[str]:
  with open(path, encoding='utf-8') as f:
    lines = [line.strip() for line in f if line.strip()]
  if not lines:
    raise ValueError(f'--sentences={path} holds no text')
  return [lines[i % len(lines)] for i in range(count)]


# --mode=random


def _source_lengths(path: str, count: int, per_word: float, longest: int) -> list[int]:
  with open(path, encoding='utf-8') as f:
    words = [len(line.split()) for line, _ in zip(f, range(count))]
  return [min(max(1, math.ceil(n * per_word)), longest - 1) + 1 for n in words]  # + EOS.


def _random_line(config, beam_size: int) -> dict:
  mesh, axis_rules = sharding.make_mesh(config.mesh), sharding.rules(config.mesh)
  model_config = TransformerConfig.from_config(config.model, data.vocab_size(config),
                                               jax.devices()[0].platform)
  params = _random_params(model_config, mesh, axis_rules)
  lengths = _source_lengths(_SENTENCES.value, _NUM_SENTENCES.value, 1.3,
                            min(config.data.max_len, config.model.max_len))
  rng = np.random.default_rng(0)
  inputs = [np.append(rng.integers(2, model_config.vocab_size, n - 1), EOS_ID).astype(np.int32)
            for n in lengths]
  translator = translator_lib.Translator(model_config, mesh, axis_rules, config.data.batch_tokens,
                                 config.data.min_bucket, config.eval.max_extra_len,
                                 beam_size=beam_size, alpha=config.eval.alpha,
                                 dtype=config.eval.dtype,
                                 length_penalty=config.eval.length_penalty)
  outputs = translator.translate(params, inputs)
  compile_seconds = translator.stats.compile_seconds
  seconds = common.median_seconds(lambda: translator.translate(params, inputs),
                                  _REPEATS.value, warmup=0)
  target_tokens = _output_tokens(outputs)
  return {
      'benchmark': 'decode', 'mode': 'random', 'config': config.name, **common.device_info(),
      'search': 'greedy' if beam_size == 1 else 'beam', 'beam_size': beam_size,
      'alpha': config.eval.alpha, 'dtype': config.eval.dtype,
      'params': sum(x.size for x in jax.tree.leaves(params)), 'sentences': len(inputs),
      'source_tokens': int(sum(lengths)), 'target_tokens': target_tokens,
      'max_extra_len': config.eval.max_extra_len, 'seconds': round(seconds, 3),
      'sentences_per_second': round(len(inputs) / seconds, 2),
      'target_tokens_per_second': round(target_tokens / seconds, 1),
      'compile_seconds': round(compile_seconds, 2)}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  beam_sizes = [int(b) for b in _BEAM_SIZES.value]
  if _MODE.value == 'reference':
    reference = flax_reference.import_reference(_REFERENCE_DIR.value)
    matmul = common.Matmul(2048, jnp.float32)
    for beam_size in beam_sizes:
      print(cli.json_line(_reference_line(reference, beam_size, matmul)), flush=True)
  elif _MODE.value == 'text':
    lines = _read_lines(_SENTENCES.value, _NUM_SENTENCES.value)
    with tempfile.TemporaryDirectory(prefix='t2t_decode_bench_') as directory:
      for batch_tokens in map(int, _BATCH_TOKENS.value):
        run = _text_run(directory, _CONFIG.value, lines, batch_tokens)
        for beam_size in beam_sizes:
          run.translator.beam_size = beam_size
          record, t2t_texts = _text_lines(run, lines, beam_size, batch_tokens)
          print(cli.json_line(record), flush=True)
          if not _CTRANSLATE2.value or batch_tokens != int(_BATCH_TOKENS.value[0]):
            continue
          references = (_read_lines(_REFERENCES.value, _NUM_SENTENCES.value)
                        if _REFERENCES.value else [])
          for compute_type in _CTRANSLATE2.value:
            print(cli.json_line(_ctranslate2_line(run, directory, lines, beam_size,
                                                  compute_type, t2t_texts, references)),
                  flush=True)
  else:
    for beam_size in beam_sizes:
      print(cli.json_line(_random_line(_CONFIG.value, beam_size)), flush=True)


if __name__ == '__main__':
  cli.run(main, compilation_cache=None)  # Timed compiles stay fresh unless asked.
