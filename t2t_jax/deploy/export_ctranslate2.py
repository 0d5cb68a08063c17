"""A t2t_jax model as a CTranslate2 model directory, built through CTranslate2's own model
specifications and converter base class: an encoder-decoder as a `TransformerSpec` (for
ctranslate2.Translator), a decoder-only model as a `TransformerDecoderModelSpec` (for
ctranslate2.Generator, ctranslate2_decoder_only.py).

  python -m t2t_jax.export --format=ctranslate2 --workdir=/tmp/run --output=/tmp/run_ct2

What has to agree for CTranslate2 to compute t2t_jax's function (docs/translation.md):
- Kernels: queries/keys/values are [E, H, D] and outputs [H, D, E] in t2t_jax; CTranslate2's
  linear layers are [out, in] with heads major in the out axis, and self-attention fuses
  Q, K, V (cross-attention K, V) into one layer. Queries are scaled by D^-0.5 inside both.
- Embeddings times sqrt(d_model). Position tables (sinusoidal interleaved sin/cos, or
  predictive/learned/none) are t2t_jax's own, given explicitly: CTranslate2's built-in
  sinusoids put all sines before all cosines. Rotary, relative and ALiBi positions map to
  CTranslate2's own (ctranslate2_layers.stack_options). Positions count from 0 on both sides.
- Post-LN or pre-LN (`pre_norm`, with the final norms), LayerNorm epsilon 1e-6 (flax's).
- Ids: PAD=0 is t2t_jax's decoder start, EOS=1 ends outputs and is appended to every source
  (`add_source_eos`). PAD is never generated: the output layer gets a bias of
  ctranslate2_layers.PAD_LOGIT_BIAS at PAD, so CTranslate2's scores are normalised over the
  other tokens (t2t_jax's softmax still counts PAD's small probability;
  tests/test_ctranslate2.py checks both).

The members CTranslate2 cannot express are refused by `check_exportable`, before any
checkpoint is read.
"""

import os

import ctranslate2
import jax
import numpy as np

from t2t_jax import CheckpointError, ConfigError
from t2t_jax import EOS_ID, PAD_ID
from t2t_jax import workdir_layout
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import tokenizer
from t2t_jax.deploy import ctranslate2_decoder_only
from t2t_jax.deploy import ctranslate2_layers as layers
from t2t_jax.model.attention import attention_kinds
from t2t_jax.model.model_config import TransformerConfig
from t2t_jax.model.transformer import unstack_layer_params

# CTranslate2 weight types (`--quantization`); None keeps float32. compute_type is chosen when
# the model is loaded (ctranslate2.Translator(path, compute_type='int8')).
QUANTIZATIONS = ('int8', 'int8_float32', 'int8_float16', 'int8_bfloat16', 'int16', 'float16',
                 'bfloat16', 'float32')


def refusals(config: TransformerConfig) -> list[tuple[bool, str, str]]:
  """(refused, key, why) for each setting CTranslate2 cannot express, in the order checked."""
  decoder_only = config.kind == 'decoder_only'
  return [
      (config.kind == 'encoder_only', 'kind',
       'an encoder-only model translates nothing, and CTranslate2 runs its encoders (BERT-like '
       'models) only up to the final states and pooler: the masked-LM and classifier heads '
       "would run outside it, so t2t_jax exports translation models only"),
      (config.moe_experts > 0, 'moe_experts',
       'CTranslate2 has no mixture-of-experts feed-forward layers'),
      (set(attention_kinds(config.attention_pattern)) != {'full'}, 'attention_pattern',
       "CTranslate2 runs dense ('full') attention only: it has no local windows or "
       'memory-compressed keys'),
      (decoder_only and config.prefix_attention == 'full', 'prefix_attention',
       'the source of this decoder-only model attends to later source tokens (a prefix '
       "language model), and CTranslate2's decoder-only model is causal over the whole "
       "sequence: only a model trained with prefix_attention='causal' can be exported"),
      (decoder_only and not config.share_embeddings, 'share_embeddings',
       'this decoder-only model embeds source and target tokens with two tables, and '
       "CTranslate2's decoder-only model embeds every token with one"),
      (decoder_only and config.positions == 'learned', 'positions',
       'this decoder-only model adds one learned position table to the source and another to '
       "the target, and CTranslate2's decoder-only model adds one table by position"),
      (not decoder_only and config.positions == 'alibi', 'positions',
       "ALiBi's bias in the encoder, -m|i - j|, reaches later keys too, and CTranslate2 adds "
       "ALiBi in decoders only, where it is causal; its encoder has no attention bias"),
  ]


def check_exportable(config: TransformerConfig) -> None:
  """Raises ConfigError naming the first setting CTranslate2 cannot express."""
  for refused, key, why in refusals(config):
    if refused:
      raise ConfigError(f'config.model.{key}={getattr(config, key)!r} cannot be exported to '
                        f'CTranslate2: {why}')


def vocabulary_tokens(vocab: tokenizer.Vocabulary) -> list[str]:
  """One token string per id: SentencePiece pieces, or <pad>, </s> and the task's symbols."""
  tokens = [vocab.piece(i) for i in range(vocab.vocab_size)]
  repeated = sorted({t for t in tokens if tokens.count(t) > 1})
  if repeated:
    raise ConfigError(f'the vocabulary names several ids {repeated[:5]}: CTranslate2 needs one '
                      'string per id')
  return tokens


def build_spec(config: TransformerConfig, params: dict, tokens: list[str],
               unk_token: str | None):
  """The CTranslate2 spec of `params` (unboxed, unrolled, float32 numpy): a TransformerSpec,
  or for a decoder-only model a TransformerDecoderModelSpec."""
  check_exportable(config)
  if config.kind == 'decoder_only':
    return ctranslate2_decoder_only.build_spec(config, params, tokens, unk_token)
  specs = ctranslate2.specs
  encoder = specs.TransformerEncoderSpec(config.num_encoder_layers, config.num_heads,
                                         **layers.stack_options(config))
  decoder = specs.TransformerDecoderSpec(config.num_decoder_layers, config.num_heads,
                                         **layers.decoder_options(config))
  spec = specs.TransformerSpec(encoder, decoder)
  layers.embed(encoder, encoder.embeddings[0], config, params, 'source')
  layers.embed(decoder, decoder.embeddings, config, params, 'target')
  if config.norm == 'pre':
    layers.layer_norm(encoder.layer_norm, params['encoder_norm'])
    layers.layer_norm(decoder.layer_norm, params['decoder_norm'])
  layers.encoder_layers(encoder, params)
  layers.decoder_layers(decoder, params, cross_attention=True)
  layers.output_layer(decoder, config, params)
  spec.register_source_vocabulary(tokens)
  spec.register_target_vocabulary(tokens)
  spec.config.layer_norm_epsilon = layers.LAYER_NORM_EPSILON
  spec.config.decoder_start_token = tokens[PAD_ID]  # t2t_jax's shift_right puts 0 first.
  spec.config.bos_token = tokens[PAD_ID]
  spec.config.eos_token = tokens[EOS_ID]
  spec.config.add_source_eos = True  # t2t_jax's sources end in EOS too.
  spec.config.unk_token = unk_token if unk_token is not None else tokens[PAD_ID]
  return spec


class _Converter(ctranslate2.converters.Converter):
  """CTranslate2's converter protocol: `_load` returns the spec, `convert` validates,
  quantizes and writes it."""

  def __init__(self, spec):
    self._spec = spec

  def _load(self):
    return self._spec


def float32_params(params, config: TransformerConfig) -> dict:
  """Checkpoint params as unrolled float32 numpy arrays (scan_layers stacks are split)."""
  if config.scan_layers:
    params = unstack_layer_params(params, config)
  return jax.tree.map(lambda x: np.asarray(x, np.float32), params)


def export(workdir: str, checkpoint_name: str | None = None, output: str = '',
           quantization: str | None = None, weights: str = 'params') -> str:
  """Writes the CTranslate2 model of one checkpoint of a run (of its params, or with
  `weights`='ema' of their moving average); returns the directory."""
  from t2t_jax.checkpoints import run_files  # pylint: disable=g-import-not-at-top  # Config and vocabulary.
  if quantization is not None and quantization not in QUANTIZATIONS:
    raise ConfigError(f'--quantization={quantization!r} must be one of {QUANTIZATIONS}')
  config = run_files.load_config(workdir)
  vocab = run_files.load_vocabulary(config, workdir)
  model_config = TransformerConfig.from_config(config.model, vocab.vocab_size,
                                               jax.devices()[0].platform)
  check_exportable(model_config)
  path = saved_params.checkpoint_path(workdir, checkpoint_name)
  output = output or os.path.join(
      workdir_layout.export_dir(workdir),
      f'{os.path.basename(os.path.normpath(path))}{"_ema" if weights == "ema" else ""}'
      f'_ctranslate2_{quantization or "float32"}')
  if os.path.exists(output):
    raise CheckpointError(f'{output} already exists: remove it or choose another --output')
  params = float32_params(saved_params.load_params(path, weights=weights), model_config)
  unk = (vocab.piece(tokenizer.UNK_ID) if isinstance(vocab, tokenizer.SentencePieceVocabulary)
         else None)
  spec = build_spec(model_config, params, vocabulary_tokens(vocab), unk)
  return _Converter(spec).convert(output, quantization=quantization)
