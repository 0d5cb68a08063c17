"""A t2t_jax encoder-decoder as a CTranslate2 model directory, built through CTranslate2's own
model specification (`ctranslate2.specs.TransformerSpec`) and converter base class.

  python -m t2t_jax.export --format=ctranslate2 --workdir=/tmp/run --output=/tmp/run_ct2

What has to agree for CTranslate2 to compute t2t_jax's function (docs/translation.md):
- Kernels: queries/keys/values are [E, H, D] and outputs [H, D, E] in t2t_jax; CTranslate2's
  linear layers are [out, in] with heads major in the out axis, and self-attention fuses
  Q, K, V (cross-attention K, V) into one layer. Queries are scaled by D^-0.5 inside both.
- Embeddings times sqrt(d_model); positions are t2t_jax's own table (sinusoidal interleaved
  sin/cos, or predictive/learned/none), given explicitly: CTranslate2's built-in sinusoids put
  all sines before all cosines. Positions count from 0 on both sides.
- Post-LN or pre-LN (`pre_norm`, with the final norms), LayerNorm epsilon 1e-6 (flax's).
- Ids: PAD=0 is t2t_jax's decoder start, EOS=1 ends outputs and is appended to every source
  (`add_source_eos`). PAD is never generated: the output layer gets a bias of PAD_LOGIT_BIAS
  at PAD, so CTranslate2's scores are normalised over the other tokens (t2t_jax's softmax
  still counts PAD's small probability; tests/test_ctranslate2.py checks both).
"""

import math
import os

import ctranslate2
import jax
import numpy as np

from t2t_jax import CheckpointError, ConfigError
from t2t_jax import EOS_ID, PAD_ID
from t2t_jax import saved_params
from t2t_jax import tokenizer
from t2t_jax.attention import attention_kinds
from t2t_jax.model import unstack_layer_params
from t2t_jax.model_config import TransformerConfig
from t2t_jax.positions import predictive_positions, sinusoidal_positions

# Added to PAD's output logit: no float16 overflow, and exp() of it is 0 in every dtype.
PAD_LOGIT_BIAS = -1.0e4
LAYER_NORM_EPSILON = 1e-6  # flax.linen.LayerNorm's default, which model.LayerNorm keeps.
# CTranslate2 weight types (`--quantization`); None keeps float32. compute_type is chosen when
# the model is loaded (ctranslate2.Translator(path, compute_type='int8')).
QUANTIZATIONS = ('int8', 'int8_float32', 'int8_float16', 'int8_bfloat16', 'int16', 'float16',
                 'bfloat16', 'float32')


def check_exportable(config: TransformerConfig) -> None:
  """Raises ConfigError naming the first setting CTranslate2's Transformer cannot express."""
  refusals = [
      (config.kind != 'encoder_decoder', 'kind', config.kind,
       'only encoder-decoder models are exported'),
      (config.moe_experts > 0, 'moe_experts', config.moe_experts,
       'CTranslate2 has no mixture-of-experts feed-forward layers'),
      (set(attention_kinds(config.attention_pattern)) != {'full'}, 'attention_pattern',
       config.attention_pattern, "CTranslate2 runs dense ('full') attention only"),
      (config.positions == 'relative', 'positions', config.positions,
       "this export maps absolute position tables only ('sinusoidal', 'predictive', "
       "'learned', 'none')"),
  ]
  for refused, key, value, why in refusals:
    if refused:
      raise ConfigError(f'config.model.{key}={value!r} cannot be exported to CTranslate2: '
                        f'{why}')


def position_table(config: TransformerConfig, params: dict, side: str) -> np.ndarray:
  """The [max_len, E] table t2t_jax adds to `side`'s ('source' or 'target') embeddings."""
  if config.positions == 'learned':
    return params[f'{side}_embedder']['position_embedding']
  if config.positions == 'none':
    return np.zeros((config.max_len, config.d_model), np.float32)
  tables = {'sinusoidal': sinusoidal_positions, 'predictive': predictive_positions}
  return tables[config.positions](config.max_len, config.d_model)


def vocabulary_tokens(vocab: tokenizer.Vocabulary) -> list[str]:
  """One token string per id: SentencePiece pieces, or <pad>, </s> and the task's symbols."""
  tokens = [vocab.piece(i) for i in range(vocab.vocab_size)]
  repeated = sorted({t for t in tokens if tokens.count(t) > 1})
  if repeated:
    raise ConfigError(f'the vocabulary names several ids {repeated[:5]}: CTranslate2 needs one '
                      'string per id')
  return tokens


def _linear(spec, kernel_in_out: np.ndarray, bias: np.ndarray | None = None) -> None:
  """A [in, out] kernel (flax's layout) as CTranslate2's [out, in] weight."""
  spec.weight = np.ascontiguousarray(kernel_in_out.T)
  if bias is not None:
    spec.bias = bias


def _projection(kernel_EHD: np.ndarray) -> np.ndarray:
  """A query/key/value kernel [E, H, D] as [E, H*D]: heads major, as CTranslate2 splits them."""
  return kernel_EHD.reshape(kernel_EHD.shape[0], -1)


def _layer_norm(spec, params: dict) -> None:
  spec.gamma, spec.beta = params['scale'], params['bias']


def _self_attention(spec, params: dict) -> None:
  fused = np.concatenate([_projection(params[name]) for name in ('query', 'key', 'value')], 1)
  _linear(spec.linear[0], fused)
  _linear(spec.linear[1], params['out'].reshape(-1, params['out'].shape[-1]))


def _cross_attention(spec, params: dict) -> None:
  _linear(spec.linear[0], _projection(params['query']))
  _linear(spec.linear[1], np.concatenate([_projection(params['key']),
                                          _projection(params['value'])], 1))
  _linear(spec.linear[2], params['out'].reshape(-1, params['out'].shape[-1]))


def _feed_forward(spec, params: dict) -> None:
  _linear(spec.linear_0, params['wi']['kernel'], params['wi']['bias'])
  _linear(spec.linear_1, params['wo']['kernel'], params['wo']['bias'])


def build_spec(config: TransformerConfig, params: dict, tokens: list[str],
               unk_token: str | None):
  """The CTranslate2 TransformerSpec of `params` (unboxed, unrolled, float32 numpy)."""
  check_exportable(config)
  spec = ctranslate2.specs.TransformerSpec.from_config(
      (config.num_encoder_layers, config.num_decoder_layers), config.num_heads,
      pre_norm=config.norm == 'pre', activation=ctranslate2.specs.Activation.RELU)
  source_embedding = params['embedding' if config.share_embeddings else 'source_embedding']
  encoder, decoder = spec.encoder, spec.decoder
  encoder.embeddings[0].weight = source_embedding['embedding']
  decoder.embeddings.weight = params['embedding']['embedding']
  for side, stack in (('source', encoder), ('target', decoder)):
    stack.scale_embeddings = math.sqrt(config.d_model)
    stack.position_encodings.encodings = position_table(config, params, side)
  if config.norm == 'pre':
    _layer_norm(encoder.layer_norm, params['encoder_norm'])
    _layer_norm(decoder.layer_norm, params['decoder_norm'])
  for i, layer in enumerate(encoder.layer):
    layer_params = params[f'encoder_{i}']
    _self_attention(layer.self_attention, layer_params['self_attention'])
    _layer_norm(layer.self_attention.layer_norm, layer_params['attention_block']['norm'])
    _feed_forward(layer.ffn, layer_params['ffn'])
    _layer_norm(layer.ffn.layer_norm, layer_params['ffn_block']['norm'])
  for i, layer in enumerate(decoder.layer):
    layer_params = params[f'decoder_{i}']
    _self_attention(layer.self_attention, layer_params['self_attention'])
    _layer_norm(layer.self_attention.layer_norm, layer_params['self_attention_block']['norm'])
    _cross_attention(layer.attention, layer_params['cross_attention'])
    _layer_norm(layer.attention.layer_norm, layer_params['cross_attention_block']['norm'])
    _feed_forward(layer.ffn, layer_params['ffn'])
    _layer_norm(layer.ffn.layer_norm, layer_params['ffn_block']['norm'])
  output_kernel = (params['embedding']['embedding'].T if config.tie_output
                   else params['output_projection']['kernel'])
  pad_bias = np.zeros((config.vocab_size,), np.float32)
  pad_bias[PAD_ID] = PAD_LOGIT_BIAS
  _linear(decoder.projection, output_kernel, pad_bias)
  spec.register_source_vocabulary(tokens)
  spec.register_target_vocabulary(tokens)
  spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
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
  from t2t_jax import run_files  # pylint: disable=g-import-not-at-top  # Config and vocabulary.
  if quantization is not None and quantization not in QUANTIZATIONS:
    raise ConfigError(f'--quantization={quantization!r} must be one of {QUANTIZATIONS}')
  config = run_files.load_config(workdir)
  vocab = run_files.load_vocabulary(config, workdir)
  model_config = TransformerConfig.from_config(config.model, vocab.vocab_size,
                                               jax.devices()[0].platform)
  check_exportable(model_config)
  path = saved_params.resolve(workdir, checkpoint_name)
  output = output or os.path.join(
      os.path.abspath(workdir), 'export',
      f'{os.path.basename(os.path.normpath(path))}{"_ema" if weights == "ema" else ""}'
      f'_ctranslate2_{quantization or "float32"}')
  if os.path.exists(output):
    raise CheckpointError(f'{output} already exists: remove it or choose another --output')
  params = float32_params(saved_params.load_params(path, weights=weights), model_config)
  unk = (vocab.piece(tokenizer.UNK_ID) if isinstance(vocab, tokenizer.SentencePieceVocabulary)
         else None)
  spec = build_spec(model_config, params, vocabulary_tokens(vocab), unk)
  return _Converter(spec).convert(output, quantization=quantization)
