"""A trained run loaded for translation, by t2t_jax's engine or CTranslate2's: its config,
vocabulary, parameters and translator; lines in, translations out (the translate and
evaluate commands share it, with the flags that choose the engine).
"""


import dataclasses
import os
import sys
import time

from absl import app
from absl import flags
from absl import logging
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm

from t2t_jax import ConfigError
from t2t_jax import EOS_ID
from t2t_jax import sharding
from t2t_jax.checkpoints import saved_params
from t2t_jax.checkpoints.run_files import load_config, load_vocabulary
from t2t_jax.data import tokenizer
from t2t_jax.data.sources import DataError
from t2t_jax.decoding import sampling as sampling_lib
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.decoding.decode import LENGTH_PENALTIES
from t2t_jax.deploy import ctranslate2_engine
from t2t_jax.model.model_config import TransformerConfig
from t2t_jax.model.transformer import Transformer
from t2t_jax.training import build

FLAGS = flags.FLAGS

ENGINES = ('t2t_jax', 'ctranslate2')


@dataclasses.dataclass
class Run:
  """A trained model ready to translate: its config, vocabulary, parameters and decoder (a
  translator.Translator, or a ctranslate2_engine.Translator with params None)."""
  config: ml_collections.ConfigDict
  vocab: tokenizer.Vocabulary
  model_config: TransformerConfig
  params: object
  translator: translator_lib.Translator | ctranslate2_engine.Translator


def _read_run(workdir: str, language_model: bool = False
              ) -> tuple[ml_collections.ConfigDict, tokenizer.Vocabulary]:
  """A run's config and vocabulary: a translation model's, or with `language_model` a
  language model's (config.data.source='lm')."""
  config = load_config(workdir)
  if config.model.kind == 'encoder_only':
    raise ConfigError(f"{workdir} holds an encoder-only model (config.model.kind="
                      "'encoder_only'), which translates nothing: classify with python -m "
                      't2t_jax.classify (docs/pretraining.md)')
  if config.data.source == 'lm' and not language_model:
    raise ConfigError(f"{workdir} holds a language model (config.data.source='lm'), which has "
                      'no source to translate: continue prompts with python -m '
                      't2t_jax.generate (docs/translation.md)')
  if language_model and config.data.source != 'lm':
    raise ConfigError(f'{workdir} holds a translation model (config.data.source='
                      f"{config.data.source!r}), not a language model: sample translations "
                      'with python -m t2t_jax.translate --sampling=sample')
  return config, load_vocabulary(config, workdir)


def load(workdir: str, checkpoint: str | None = None, beam_size: int | None = None,
         alpha: float | None = None, batch_tokens: int | None = None,
         dtype: str | None = None, weights: str = 'params',
         length_penalty: str | None = None, sampling: sampling_lib.Sampling | None = None,
         language_model: bool = False, max_extra_len: int | None = None) -> Run:
  """Config, vocabulary and parameters of a run (`weights`='ema': their moving average);
  unset decoding options come from its config. With `sampling` the outputs are drawn; a
  `language_model` run continues prompts (translator.Translator's `prompts`)."""
  config, vocab = _read_run(workdir, language_model)
  mesh = sharding.make_mesh(config.mesh)
  axis_rules = sharding.rules(config.mesh)
  model_config = TransformerConfig.from_config(config.model, vocab.vocab_size,
                                               mesh.devices.flat[0].platform)
  params = saved_params.restore_params(
      workdir, build.abstract_params(model_config, mesh, axis_rules), checkpoint, weights)
  translator = translator_lib.from_config(config, model_config, mesh, axis_rules, beam_size,
                                          alpha, batch_tokens or None, dtype, length_penalty,
                                          sampling, prompts=language_model,
                                          max_extra_len=max_extra_len)
  return Run(config, vocab, model_config, params, translator)


def load_ctranslate2(workdir: str, checkpoint: str | None = None, beam_size: int | None = None,
                     alpha: float | None = None, batch_tokens: int | None = None,
                     weights: str = 'params', length_penalty: str | None = None,
                     patience: float | None = None, compute_type: str = 'float32',
                     threads: int = 0) -> Run:
  """`load` with CTranslate2 searching: the checkpoint exported to the workdir's cache (once),
  loaded in `compute_type` with `threads` threads (0: CTranslate2's default); `patience`
  ctranslate2_engine.Decoding's."""
  config, vocab = _read_run(workdir)
  model_config = TransformerConfig.from_config(config.model, vocab.vocab_size, 'cpu')
  translator = ctranslate2_engine.from_config(
      config, model_config, vocab, workdir, checkpoint, weights, beam_size, alpha,
      batch_tokens or None, length_penalty, patience, compute_type, threads)
  return Run(config, vocab, model_config, None, translator)


def encode_lines(vocab, lines, max_tokens: int, name: str, first_line: int = 0,
                 eos: bool = True) -> list[np.ndarray]:
  """Ids ending in EOS (unless not `eos`) per line; empty lines give no ids; longer lines are
  cut with a warning. Messages number lines[0] as line `first_line` + 1."""
  lines = [line.strip() for line in lines]
  texts = [line for line in lines if line]
  try:
    ids_of_texts = iter(vocab.encode(texts))
  except ValueError:  # Find the line at fault.
    for number, line in enumerate(lines, start=first_line + 1):
      try:
        vocab.encode([line])
      except ValueError as e:
        raise DataError(f'{name}:{number}: {e}') from None
    raise
  encoded = []
  for number, line in enumerate(lines, start=first_line + 1):
    if not line:
      encoded.append(np.zeros((0,), np.int32))
      continue
    ids = list(next(ids_of_texts))
    if len(ids) + eos > max_tokens:
      logging.warning('%s:%d: %d tokens, truncated to the first %d (the model reads at most %d'
                      '%s)', name, number, len(ids), max_tokens - eos, max_tokens,
                      ' including EOS' if eos else '')
      ids = ids[:max_tokens - eos]
    encoded.append(np.asarray(ids + [EOS_ID] * eos, np.int32))
  return encoded


def translate_lines(run: Run, lines, name: str = '<stdin>', progress: bool = False,
                    samples: int = 1, first_line: int = 0,
                    noise: sampling_lib.Noise | None = None,
                    ) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
  """Translations of `lines` in order, with the source and output ids behind them.

  Sampling (the run's translator's) or with `noise` (a noised beam: the beam output with
  sampling_lib.noise_words), `samples` translations per line, one after the other;
  `first_line` is lines[0]'s index in the whole input, which the draws depend on.
  """
  max_tokens = min(run.config.data.max_len, run.model_config.max_len)
  if run.model_config.kind == 'decoder_only':  # Its outputs' positions follow the source's.
    max_tokens = min(max_tokens, run.model_config.max_len - 1)
  start = time.perf_counter()
  inputs = encode_lines(run.vocab, lines, max_tokens, name, first_line)
  text_seconds = time.perf_counter() - start
  drawn = getattr(run.translator, 'sampling', None) is not None
  with tqdm.tqdm(total=len(inputs) * (samples if drawn else 1), desc='translating',
                 unit=' sentences', file=sys.stderr, disable=not progress) as bar:
    if drawn:
      outputs = run.translator.translate(run.params, inputs, progress=bar.update,
                                         samples=samples, first_line=first_line)
    else:
      outputs = run.translator.translate(run.params, inputs, progress=bar.update)
  start = time.perf_counter()
  translations = [run.vocab.decode(o) if len(o) else '' for o in outputs]
  if noise:
    translations = [sampling_lib.noise_words(
        translations[n], sampling_lib.line_rng(noise.seed, first_line + n, sample), noise)
                    for n in range(len(inputs)) for sample in range(samples)]
    outputs = [outputs[n] for n in range(len(inputs)) for _ in range(samples)]
  run.translator.stats.text_seconds += text_seconds + time.perf_counter() - start
  return translations, inputs, outputs


def summary(translator, tokens: int) -> str:
  """One line of throughput (`tokens` output tokens in all), and where the time went."""
  stats = translator.stats
  seconds = stats.seconds + stats.text_seconds
  outside = seconds - stats.search_seconds
  head = (f'Translated {stats.sentences} sentences in {seconds:.1f} s: '
          f'{stats.sentences / seconds:.1f} sentences/s, {tokens / seconds:.0f} target tokens/s; ')
  if translator.engine == 'ctranslate2':
    return head + (
        f'CTranslate2 {translator.compute_type}, {stats.batches} batches; '
        f'{outside / seconds:.0%} of the time outside its search (tokenising '
        f'{stats.text_seconds:.1f} s); model loaded in {translator.load_seconds:.1f} s')
  return head + (
      f'{stats.batches} batches, {stats.shapes_compiled} shapes compiled in '
      f'{stats.compile_seconds:.1f} s; {outside / seconds:.0%} of the time outside the '
      f'compiled search (compiling, tokenising {stats.text_seconds:.1f} s, batching)')


def _strip_to_eos(ids) -> list[int]:
  ids = [int(i) for i in ids]
  return ids[:ids.index(EOS_ID) + 1] if EOS_ID in ids else ids


def cross_attention(run: Run, source_ids, output_ids) -> list[np.ndarray]:
  """Encoder-decoder attention [heads, output, source] of every decoder layer."""
  if run.model_config.kind != 'encoder_decoder':
    raise app.UsageError('--attention_png draws encoder-decoder attention, and this run\'s '
                         f'model (config.model.kind={run.model_config.kind!r}) has none')
  # Only the einsum path materialises (and records) the attention weights.
  model = Transformer(dataclasses.replace(run.model_config, deterministic=True,
                                          attention_impl='einsum'))
  _, state = model.apply({'params': run.params}, jnp.asarray(source_ids)[None],
                         jnp.asarray(output_ids)[None], mutable=['intermediates'])
  layers = state['intermediates']
  if run.model_config.scan_layers:  # One sown array [layers, B, H, Q, K] for the whole stack.
    stacked = layers['decoder_layers']['cross_attention']['attention_weights'][0]
    return [np.asarray(weights_BHQK[0], np.float32) for weights_BHQK in stacked]
  return [np.asarray(layers[f'decoder_{i}']['cross_attention']['attention_weights'][0][0],
                     np.float32) for i in range(run.model_config.num_decoder_layers)]


def save_attention_pngs(run: Run, source_ids, output_ids, directory: str,
                        prefix: str) -> list[str]:
  """One PNG per decoder layer of encoder-decoder attention, one panel per head."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  output_ids = _strip_to_eos(output_ids)
  source_names = [run.vocab.piece(i) for i in source_ids]
  output_names = [run.vocab.piece(i) for i in output_ids]
  os.makedirs(directory, exist_ok=True)
  paths = []
  for layer, weights_HQK in enumerate(cross_attention(run, source_ids, output_ids)):
    heads = weights_HQK.shape[0]
    columns = min(heads, 4)
    rows = -(-heads // columns)
    width, height = 1.5 + 0.3 * len(source_names), 1.5 + 0.3 * len(output_names)
    figure, axes = plt.subplots(rows, columns, squeeze=False,
                                figsize=(columns * width, rows * height))
    for head, axis in enumerate(axes.flat):
      if head >= heads:
        axis.axis('off')
        continue
      axis.imshow(weights_HQK[head], cmap='viridis', vmin=0.0, vmax=weights_HQK.max(),
                  aspect='equal')
      axis.set_title(f'head {head + 1}', fontsize=9)
      axis.set_xticks(range(len(source_names)), source_names, rotation=90, fontsize=7)
      axis.set_yticks(range(len(output_names)), output_names, fontsize=7)
      axis.set_xlabel('source', fontsize=8)
      axis.set_ylabel('output', fontsize=8)
    figure.suptitle(f'encoder-decoder attention, decoder layer {layer + 1}')
    figure.tight_layout()
    path = os.path.join(directory, f'{prefix}_layer{layer + 1}.png')
    figure.savefig(path, dpi=100)
    plt.close(figure)
    paths.append(path)
  return paths


def define_engine_flags():
  """The flags that choose the engine and its search (translate's and evaluate's)."""
  flags.DEFINE_enum('engine', 't2t_jax', list(ENGINES), "t2t_jax: t2t_jax's compiled search; "
                    'ctranslate2: CTranslate2 on the checkpoint, exported once to '
                    '<workdir>/ctranslate2/ (docs/translation.md compares their speeds).')
  flags.DEFINE_enum('length_penalty', None, list(LENGTH_PENALTIES), 'Beam scores are log p / '
                    'penalty: gnmt ((5 + length) / 6)^alpha, length length^alpha (the one '
                    'CTranslate2 has). Default: config.eval.length_penalty.')
  flags.DEFINE_enum('ct2_compute_type', 'float32', list(ctranslate2_engine.COMPUTE_TYPES),
                    '--engine=ctranslate2: the type CTranslate2 computes in (int8: the weights '
                    'quantized as it loads the float32 export).')
  flags.DEFINE_integer('ct2_threads', 0, '--engine=ctranslate2: threads; 0: OMP_NUM_THREADS, '
                       "else up to 4 cores (CTranslate2's default).", lower_bound=0)
  flags.DEFINE_float('ct2_patience', None, '--engine=ctranslate2, beam search: unset, a '
                     "sentence's search stops where t2t_jax's would give the same output (at "
                     'alpha > 0: at its length limit); N: once N x beam hypotheses have '
                     "finished, CTranslate2's own stop (1 is its default; faster, other "
                     'outputs: docs/translation.md).')


def load_from_flags(checkpoint: str | None, beam_size: int | None, alpha: float | None,
                    batch_tokens: int | None, weights: str, dtype: str | None = None,
                    sampling: sampling_lib.Sampling | None = None) -> Run:
  """`load` or `load_ctranslate2` of --workdir, as --engine asks (`sampling`: t2t_jax's)."""
  if FLAGS.engine == 'ctranslate2':
    if dtype:
      raise app.UsageError("--dtype sets t2t_jax's decoding activations: with "
                           '--engine=ctranslate2 use --ct2_compute_type')
    return load_ctranslate2(FLAGS.workdir, checkpoint, beam_size, alpha, batch_tokens, weights,
                            FLAGS.length_penalty, FLAGS.ct2_patience, FLAGS.ct2_compute_type,
                            FLAGS.ct2_threads)
  for name in ('ct2_compute_type', 'ct2_threads', 'ct2_patience'):
    if FLAGS[name].present:
      raise app.UsageError(f'--{name} applies to --engine=ctranslate2')
  return load(FLAGS.workdir, checkpoint, beam_size, alpha, batch_tokens, dtype, weights,
              FLAGS.length_penalty, sampling)
