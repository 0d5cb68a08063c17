"""t2t_jax's parameters placed into CTranslate2's layer specifications, shared by the
encoder-decoder export (export_ctranslate2.py) and the decoder-only one
(ctranslate2_decoder_only.py); docs/translation.md says what has to agree and why.

Params here are unboxed, unrolled float32 numpy arrays (`export_ctranslate2.float32_params`).
"""

import math

import ctranslate2
import numpy as np

from t2t_jax import PAD_ID
from t2t_jax.model.model_config import TransformerConfig
from t2t_jax.model.positions import ROTARY_BASE, predictive_positions, sinusoidal_positions

# Added to PAD's output logit: no float16 overflow, and exp() of it is 0 in every dtype.
PAD_LOGIT_BIAS = -1.0e4
LAYER_NORM_EPSILON = 1e-6  # flax.linen.LayerNorm's default, which model.LayerNorm keeps.
# Positions that are a table added to the embeddings: t2t_jax's own table goes in the model.
TABLE_POSITIONS = ('sinusoidal', 'predictive', 'learned', 'none')


def stack_options(config: TransformerConfig) -> dict:
  """Keyword arguments of CTranslate2's encoder and decoder specs for t2t_jax's positions.

  Rotary: every dimension of a head (rotary_dim 0), turned in interleaved pairs (x[2i],
  x[2i+1]) by position * ROTARY_BASE^(-2i/D), as positions.rotary turns them. Relative: Shaw
  et al.'s keys and values of clip(key - query, -k, k), one [2k + 1, D] table of each per
  layer, shared by the heads, in self-attention only, as attention_variants.Relative holds
  them. ALiBi is decoder-only and added by `decoder_options`.
  """
  options = dict(pre_norm=config.norm == 'pre', activation=ctranslate2.specs.Activation.RELU)
  if config.positions == 'rotary':
    options.update(rotary_dim=0, rotary_interleave=True, rotary_base=ROTARY_BASE)
  elif config.positions == 'relative':
    options.update(relative_position=True)
  return options


def decoder_options(config: TransformerConfig) -> dict:
  """`stack_options` of a decoder: ALiBi's -m_h (i - j) on the scores after the query scale.

  CTranslate2 adds m_h (j - c), c one less than the key length its bias table was built for,
  which differs from -m_h (i - j) by m_h (i - c), the same for every key of query i: the
  softmax is the same. Its slopes are Press et al.'s, positions.alibi_slopes's.
  """
  options = stack_options(config)
  if config.positions == 'alibi':
    options.update(alibi=True, alibi_use_positive_positions=False, scale_alibi=False)
  return options


def position_table(config: TransformerConfig, params: dict, side: str) -> np.ndarray:
  """The [max_len, E] table t2t_jax adds to `side`'s ('source' or 'target') embeddings."""
  if config.positions == 'learned':
    return params[f'{side}_embedder']['position_embedding']
  if config.positions == 'none':
    return np.zeros((config.max_len, config.d_model), np.float32)
  tables = {'sinusoidal': sinusoidal_positions, 'predictive': predictive_positions}
  return tables[config.positions](config.max_len, config.d_model)


def embed(stack, embeddings, config: TransformerConfig, params: dict, side: str) -> None:
  """A stack's token embeddings (scaled by sqrt(d_model)) and its position table, if any.

  Under rotary, relative or ALiBi positions there is none. A rotary encoder's spec still has
  the slot, which CTranslate2 leaves unused when the attention is rotary (filled with its own
  sinusoids otherwise, which the family test would see).
  """
  embeddings.weight = params['embedding' if side == 'target' or config.share_embeddings
                             else 'source_embedding']['embedding']
  stack.scale_embeddings = math.sqrt(config.d_model)
  if config.positions in TABLE_POSITIONS:
    stack.position_encodings.encodings = position_table(config, params, side)


def _linear(spec, kernel_in_out: np.ndarray, bias: np.ndarray | None = None) -> None:
  """A [in, out] kernel (flax's layout) as CTranslate2's [out, in] weight."""
  spec.weight = np.ascontiguousarray(kernel_in_out.T)
  if bias is not None:
    spec.bias = bias


def _projection(kernel_EHD: np.ndarray) -> np.ndarray:
  """A query/key/value kernel [E, H, D] as [E, H*D]: heads major, as CTranslate2 splits them."""
  return kernel_EHD.reshape(kernel_EHD.shape[0], -1)


def layer_norm(spec, params: dict) -> None:
  spec.gamma, spec.beta = params['scale'], params['bias']


def _self_attention(spec, params: dict) -> None:
  fused = np.concatenate([_projection(params[name]) for name in ('query', 'key', 'value')], 1)
  _linear(spec.linear[0], fused)
  _linear(spec.linear[1], params['out'].reshape(-1, params['out'].shape[-1]))
  if 'relative_key' in params:  # [2k + 1, D]: CTranslate2 reads k from the table's size.
    spec.relative_position_keys = params['relative_key']
    spec.relative_position_values = params['relative_value']


def _cross_attention(spec, params: dict) -> None:
  _linear(spec.linear[0], _projection(params['query']))
  _linear(spec.linear[1], np.concatenate([_projection(params['key']),
                                          _projection(params['value'])], 1))
  _linear(spec.linear[2], params['out'].reshape(-1, params['out'].shape[-1]))


def _feed_forward(spec, params: dict) -> None:
  _linear(spec.linear_0, params['wi']['kernel'], params['wi']['bias'])
  _linear(spec.linear_1, params['wo']['kernel'], params['wo']['bias'])


def encoder_layers(encoder, params: dict) -> None:
  for i, layer in enumerate(encoder.layer):
    layer_params = params[f'encoder_{i}']
    _self_attention(layer.self_attention, layer_params['self_attention'])
    layer_norm(layer.self_attention.layer_norm, layer_params['attention_block']['norm'])
    _feed_forward(layer.ffn, layer_params['ffn'])
    layer_norm(layer.ffn.layer_norm, layer_params['ffn_block']['norm'])


def decoder_layers(decoder, params: dict, cross_attention: bool) -> None:
  for i, layer in enumerate(decoder.layer):
    layer_params = params[f'decoder_{i}']
    _self_attention(layer.self_attention, layer_params['self_attention'])
    layer_norm(layer.self_attention.layer_norm, layer_params['self_attention_block']['norm'])
    if cross_attention:
      _cross_attention(layer.attention, layer_params['cross_attention'])
      layer_norm(layer.attention.layer_norm, layer_params['cross_attention_block']['norm'])
    _feed_forward(layer.ffn, layer_params['ffn'])
    layer_norm(layer.ffn.layer_norm, layer_params['ffn_block']['norm'])


def output_layer(decoder, config: TransformerConfig, params: dict) -> None:
  """The tied or separate output projection, with PAD_LOGIT_BIAS at PAD: t2t_jax never
  generates PAD, and CTranslate2 can only keep a token out by its logit."""
  kernel = (params['embedding']['embedding'].T if config.tie_output
            else params['output_projection']['kernel'])
  pad_bias = np.zeros((config.vocab_size,), np.float32)
  pad_bias[PAD_ID] = PAD_LOGIT_BIAS
  _linear(decoder.projection, kernel, pad_bias)
