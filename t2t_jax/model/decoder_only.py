"""The decoder-only Transformer (Transformer-D, Liu et al. 2018), and `make_model`, which picks
the assembly config.model.kind names.

Shapes in names follow the package legend (t2t_jax/__init__.py).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from t2t_jax import PAD_ID
from t2t_jax.model import moe
from t2t_jax.model.attention import SelfMask, attention_kinds, attention_mask
from t2t_jax.model.encoder_only import EncoderOnly
from t2t_jax.model.model_config import TransformerConfig
from t2t_jax.model.positions import Embedder
from t2t_jax.model.transformer import DecoderLayer, LayerNorm, Transformer, dense_init
from t2t_jax.model.transformer import make_embeddings, output_logits, remat_layer, scanned_stack, shift_right

Array = jax.Array


def make_model(config: TransformerConfig) -> nn.Module:
  """The model assembly `config.kind` names: `Transformer`, `DecoderOnly` or `EncoderOnly`."""
  if config.kind == 'encoder_only':
    return EncoderOnly(config)
  return DecoderOnly(config) if config.kind == 'decoder_only' else Transformer(config)


def prefix_lm_mask(key_valid_BL: Array, source_BL: Array, segments_BL: Array | None,
                   full_prefix: bool) -> Array:
  """Mask [B, 1, L, L] of joined rows (each example's source, then its target, in order).

  Causal throughout; with `full_prefix` the source tokens (`source_BL`) also see every
  (valid, same segment) source token, later ones included: a prefix language model.
  """
  causal_B1LL = attention_mask(key_valid_BL, segments_BL, segments_BL, causal=True)
  if not full_prefix:
    return causal_B1LL
  visible_B1LL = attention_mask(key_valid_BL, segments_BL, segments_BL, causal=False)
  return causal_B1LL | (visible_B1LL & source_BL[:, None, :, None] & source_BL[:, None, None, :])


def joined_order(valid_BL: Array, segments_BL: Array | None, positions_BL: Array) -> Array:
  """Gather indices [B, L] that lay out each example's real tokens together (its source, then
  its target; examples in packing order) from index 0, padding last.

  `positions_BL` count each example's tokens, target ones after its source's. In that order
  a window or a block of the stack holds real tokens only, the same whichever other
  examples share the batch and however wide it pads them.
  """
  length = valid_BL.shape[1]
  index_L = jnp.arange(length)
  segment_BL = 1 if segments_BL is None else segments_BL
  key_BL = jnp.where(valid_BL, segment_BL * length + positions_BL, (length + 1) * length + index_L)
  return jnp.argsort(key_BL, axis=1, stable=True)


def _take(x_BL: Array, order_BL: Array) -> Array:
  """`x_BL` [B, L, ...] (the batch axis may be 1) at the indices `order_BL` [B, L']."""
  x_BL = jnp.broadcast_to(x_BL, order_BL.shape[:1] + x_BL.shape[1:])
  return jnp.take_along_axis(x_BL, order_BL.reshape(order_BL.shape + (1,) * (x_BL.ndim - 2)),
                             axis=1)


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

  The attention pattern applies to the one stack, which reads each row in `joined_order`:
  every example's real tokens together from its first, padding last. So local windows and
  compressed blocks hold the example's own tokens only, and an output is the same whatever
  the batch: alone, beside a longer source, or packed.

  Decoding: `prefill` runs the (right-padded) sources through the stack once, filling every
  layer's cache at indices [0, S); `decode` then adds one token per call, row b's at its
  position, the row's source length plus the steps so far, which is also its cache slot: it
  overwrites the source's padding, so a row's cache holds its real tokens only, in order.
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

  def _full_mask(self, valid_BL: Array, source_BL: Array, segments_BL: Array | None):
    """The prefix-LM mask of 'full' layers, or None when the pattern has none."""
    cfg = self.config
    if 'full' not in attention_kinds(cfg.attention_pattern):
      return None
    return prefix_lm_mask(valid_BL, source_BL, segments_BL, cfg.prefix_attention == 'full')

  def __call__(self, inputs_BK: Array, targets_BL: Array,
               inputs_positions_BK: Array | None = None,
               targets_positions_BL: Array | None = None,
               inputs_segments_BK: Array | None = None,
               targets_segments_BL: Array | None = None, return_hidden: bool = False) -> Array:
    """Teacher-forced logits [B, L, V] (float32) of the target part, or its final states."""
    source_length = inputs_BK.shape[1]
    lengths_BL = _source_lengths(inputs_BK, inputs_segments_BK, targets_segments_BL)
    if targets_positions_BL is None:
      targets_positions_BL = jnp.arange(targets_BL.shape[1])[None]
    x_BLE = jnp.concatenate([
        self.source_embedder(inputs_BK, inputs_positions_BK),
        self.target_embedder(shift_right(targets_BL, targets_segments_BL),
                             targets_positions_BL + lengths_BL)], axis=1)
    if inputs_positions_BK is None:
      inputs_positions_BK = jnp.arange(source_length)[None]
    length = x_BLE.shape[1]
    positions_BL = jnp.concatenate([  # Targets continue from their source.
        jnp.broadcast_to(inputs_positions_BK, inputs_BK.shape),
        jnp.broadcast_to(targets_positions_BL + lengths_BL, targets_BL.shape)], axis=1)
    valid_BL = jnp.concatenate([inputs_BK != PAD_ID, targets_BL != PAD_ID], axis=1)
    segments_BL = (None if targets_segments_BL is None else
                   jnp.concatenate([inputs_segments_BK, targets_segments_BL], axis=1))
    order_BL = joined_order(valid_BL, segments_BL, positions_BL)
    valid_BL, x_BLE = _take(valid_BL, order_BL), _take(x_BLE, order_BL)
    source_BL = _take((jnp.arange(length) < source_length)[None], order_BL)
    if segments_BL is not None:  # Packed; in an unpacked row a real token's position is its index.
      segments_BL, positions_BL = _take(segments_BL, order_BL), _take(positions_BL, order_BL)
    mask = SelfMask(self._full_mask(valid_BL, source_BL, segments_BL), valid_BL, segments_BL,
                    None if segments_BL is None else positions_BL)
    y_BLE = self._layers(x_BLE, mask, valid_BL)
    y_BLE = _take(y_BLE, jnp.argsort(order_BL, axis=1)[:, source_length:])
    return y_BLE if return_hidden else self.output_logits(y_BLE)

  def prefill(self, inputs_BS: Array) -> None:
    """Decode mode: the sources' keys and values into every layer's cache, in one pass."""
    self._next_index(inputs_BS.shape[1])
    valid_BS = inputs_BS != PAD_ID
    mask = SelfMask(self._full_mask(valid_BS, valid_BS, None), valid_BS, None, None)
    self._layers(self.source_embedder(inputs_BS), mask, valid_BS)

  def decode(self, encoded_BKE: None, inputs_BS: Array, targets_BL: Array,
             *unused_args, return_hidden: bool = False) -> Array:
    """Decode mode: logits [B, 1, V] after one more token per row (`targets_BL`, [B, 1]).

    The signature is `Transformer.decode`'s, so decoding calls either alike; there is no
    encoder output.
    """
    del encoded_BKE, unused_args
    length_B1 = (inputs_BS != PAD_ID).sum(-1, keepdims=True)
    position_B1 = length_B1 + self._next_index(1) - inputs_BS.shape[1]
    y_BLE = self.target_embedder(targets_BL, position_B1)
    # Only the positions: the slots written so far hold the row's real tokens.
    mask = SelfMask(None, None, None, position_B1)
    y_BLE = self._layers(y_BLE, mask, None)  # Every step's token is real.
    return y_BLE if return_hidden else self.output_logits(y_BLE)

  def _next_index(self, count: int) -> Array:
    """The cache index the next `count` tokens are written from; advances it by `count`."""
    current = self.cache_index.value
    self.cache_index.value = current + count
    return current

  def output_logits(self, y_BLE: Array, float32: bool = True) -> Array:
    """Output softmax logits for final states [..., E]; see `transformer.output_logits`."""
    return output_logits(self, y_BLE, float32)
