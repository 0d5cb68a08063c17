"""The decoder-only Transformer (Transformer-D, Liu et al. 2018), and `make_model`, which picks
the assembly config.model.kind names.

Shapes in names follow the package legend (t2t_jax/__init__.py).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t2t_jax import PAD_ID
from t2t_jax import moe
from t2t_jax.attention import SelfMask, attention_kinds, attention_mask
from t2t_jax.model import DecoderLayer, LayerNorm, Transformer, dense_init
from t2t_jax.model_config import TransformerConfig
from t2t_jax.model import make_embeddings, output_logits, remat_layer, scanned_stack, shift_right
from t2t_jax.positions import Embedder

Array = jax.Array


def make_model(config: TransformerConfig) -> nn.Module:
  """The model assembly `config.kind` names: `Transformer` or `DecoderOnly`."""
  return DecoderOnly(config) if config.kind == 'decoder_only' else Transformer(config)


def prefix_lm_mask(key_valid_BL: Array, source_length: int, segments_BL: Array | None,
                   full_prefix: bool) -> Array:
  """Mask [B, 1, L, L] of a "source, target" sequence whose first `source_length` are source.

  Causal throughout; with `full_prefix` the source positions also see every (valid, same
  segment) source position, later ones included: a prefix language model.
  """
  causal_B1LL = attention_mask(key_valid_BL, segments_BL, segments_BL, causal=True)
  if not full_prefix or not source_length:
    return causal_B1LL
  length = key_valid_BL.shape[1]
  source_LL = np.zeros((length, length), bool)
  source_LL[:source_length, :source_length] = True
  visible_B1LL = attention_mask(key_valid_BL, segments_BL, segments_BL, causal=False)
  return causal_B1LL | (visible_B1LL & source_LL[None, None])


def _source_lengths(inputs_BK: Array, inputs_segments_BK: Array | None,
                    targets_segments_BL: Array | None) -> Array:
  """Per target position, the length of its example's source: [B, 1], or [B, L] when packed."""
  if inputs_segments_BK is None:
    return (inputs_BK != PAD_ID).sum(-1, keepdims=True)
  # Segment ids count examples within a row, so there are fewer than L + 1 of them.
  count_segments = functools.partial(jnp.bincount, length=targets_segments_BL.shape[1] + 1)
  lengths_BS = jax.vmap(count_segments)(jnp.where(inputs_BK != PAD_ID, inputs_segments_BK, 0))
  lengths_BS = lengths_BS.at[:, 0].set(0)  # Segment 0 is padding, which has no source.
  return jnp.take_along_axis(lengths_BS, targets_segments_BL, axis=1)


class DecoderOnly(nn.Module):
  """Transformer-D (Liu et al. 2018): one causal stack over the source and target as one sequence.

  It takes the encoder-decoder's batch and concatenates inside: the sequence is the source
  (ending in EOS), then the decoder's usual input, a start token 0 and the target shifted
  right; tensor2tensor's prepend mode builds the same "inputs, 0, targets". Only the target
  part's outputs are returned, so the loss, its weights (real target tokens only) and every
  batching mode are the encoder-decoder's unchanged: a packed row keeps its separate source
  and target rows, joined here per row, the same segment ids and same-segment masking tying
  each target to its own source. Target positions continue from the source's length. A
  language model is the case of an empty (zero-width) source.

  The attention pattern applies to the one stack. Local windows and compressed blocks count
  sequence indices, so a source's padding sits between it and its target in them; relative
  positions use the positions, which skip that padding.

  Decoding: `prefill` runs the (right-padded) sources through the stack once, filling every
  layer's cache at indices [0, S); `decode` then adds one token per call at index S, S + 1,
  ..., its position the row's source length plus the steps so far, padding keys masked.
  """
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.target_embedding, self.source_embedding = make_embeddings(cfg)
    self.source_embedder = Embedder(cfg, self.source_embedding)
    self.target_embedder = Embedder(cfg, self.target_embedding)
    kinds = attention_kinds(cfg.attention_pattern)  # Repeated over the layers.
    if cfg.scan_layers:  # One kind only (check_family); MoE in every layer or none (moe.check).
      self.decoder_layers = scanned_stack(DecoderLayer, cfg, cfg.num_decoder_layers, 4)(
          cfg, use_moe=bool(cfg.moe_experts), with_cross_attention=False,
          attention_kind=kinds[0], name='decoder_layers')
    else:
      layers = cfg.num_decoder_layers
      self.decoder_layers = [remat_layer(DecoderLayer, cfg)(
          cfg, use_moe=moe.uses_moe(cfg, i, layers), with_cross_attention=False,
          attention_kind=kinds[i % len(kinds)], name=f'decoder_{i}') for i in range(layers)]
    if cfg.norm == 'pre':
      self.decoder_norm = LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    if not cfg.tie_output:
      self.output_projection = nn.Dense(
          cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
          kernel_init=dense_init(('embed', 'vocab')))
    if cfg.decode:  # The cache index the next token goes to, shared by all rows.
      self.cache_index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))

  def _layers(self, x_BLE: Array, mask: SelfMask, valid_BL: Array | None) -> Array:
    """The stack (no encoder output, no cross-attention); `valid_BL`: real tokens, for experts."""
    cfg = self.config
    if cfg.scan_layers:
      x_BLE, _ = self.decoder_layers(x_BLE, None, mask, None, valid_BL)
    else:
      for layer in self.decoder_layers:
        x_BLE = layer(x_BLE, None, mask, None, valid_BL)
    return self.decoder_norm(x_BLE) if cfg.norm == 'pre' else x_BLE

  def _full_mask(self, valid_BL: Array, source_length: int, segments_BL: Array | None):
    """The prefix-LM mask of 'full' layers, or None when the pattern has none."""
    cfg = self.config
    if 'full' not in attention_kinds(cfg.attention_pattern):
      return None
    return prefix_lm_mask(valid_BL, source_length, segments_BL, cfg.prefix_attention == 'full')

  def __call__(self, inputs_BK: Array, targets_BL: Array,
               inputs_positions_BK: Array | None = None,
               targets_positions_BL: Array | None = None,
               inputs_segments_BK: Array | None = None,
               targets_segments_BL: Array | None = None, return_hidden: bool = False) -> Array:
    """Teacher-forced logits [B, L, V] (float32) of the target part, or its final states."""
    cfg = self.config
    source_length = inputs_BK.shape[1]
    lengths_BL = _source_lengths(inputs_BK, inputs_segments_BK, targets_segments_BL)
    if targets_positions_BL is None:
      targets_positions_BL = jnp.arange(targets_BL.shape[1])[None]
    x_BLE = jnp.concatenate([
        self.source_embedder(inputs_BK, inputs_positions_BK),
        self.target_embedder(shift_right(targets_BL, targets_segments_BL),
                             targets_positions_BL + lengths_BL)], axis=1)
    valid_BL = jnp.concatenate([inputs_BK != PAD_ID, targets_BL != PAD_ID], axis=1)
    segments_BL = (None if targets_segments_BL is None else
                   jnp.concatenate([inputs_segments_BK, targets_segments_BL], axis=1))
    positions_BL = None
    if cfg.positions in ('relative', 'rotary', 'alibi'):  # Targets continue from the source.
      rows = targets_BL.shape[0]
      if inputs_positions_BK is None:
        inputs_positions_BK = jnp.arange(source_length)[None]
      positions_BL = jnp.concatenate([
          jnp.broadcast_to(inputs_positions_BK, (rows, source_length)),
          jnp.broadcast_to(targets_positions_BL + lengths_BL, targets_BL.shape)], axis=1)
    mask = SelfMask(self._full_mask(valid_BL, source_length, segments_BL), valid_BL,
                    segments_BL, positions_BL)
    y_BLE = self._layers(x_BLE, mask, valid_BL)[:, source_length:]
    return y_BLE if return_hidden else self.output_logits(y_BLE)

  def prefill(self, inputs_BS: Array) -> None:
    """Decode mode: the sources' keys and values into every layer's cache, in one pass."""
    self._next_index(inputs_BS.shape[1])
    valid_BS = inputs_BS != PAD_ID
    mask = SelfMask(self._full_mask(valid_BS, inputs_BS.shape[1], None), valid_BS, None, None)
    self._layers(self.source_embedder(inputs_BS), mask, valid_BS)

  def decode(self, encoded_BKE: None, inputs_BS: Array, targets_BL: Array,
             *unused_args, return_hidden: bool = False) -> Array:
    """Decode mode: logits [B, 1, V] after one more token per row (`targets_BL`, [B, 1]).

    The signature is `Transformer.decode`'s, so decoding calls either alike; there is no
    encoder output.
    """
    del encoded_BKE, unused_args
    length_B1 = (inputs_BS != PAD_ID).sum(-1, keepdims=True)
    step = self._next_index(1) - inputs_BS.shape[1]
    y_BLE = self.target_embedder(targets_BL, length_B1 + step)
    # The prompt part of the cache holds each row's source, then its padding.
    prompt_valid_BS = jnp.arange(inputs_BS.shape[1]) < length_B1
    mask = SelfMask(prompt_valid_BS[:, None, None, :], prompt_valid_BS, None, None)
    y_BLE = self._layers(y_BLE, mask, None)  # Every step's token is real.
    return y_BLE if return_hidden else self.output_logits(y_BLE)

  def _next_index(self, count: int) -> Array:
    """The cache index the next `count` tokens are written from; advances it by `count`."""
    current = self.cache_index.value
    self.cache_index.value = current + count
    return current

  def output_logits(self, y_BLE: Array) -> Array:
    """Output softmax logits in float32 for final states [..., E]; see `model.output_logits`."""
    return output_logits(self, y_BLE)
