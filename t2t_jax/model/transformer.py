"""The Transformer encoder-decoder of "Attention Is All You Need" in Flax linen.

Attention lives in attention.py, position encodings in positions.py, mixtures of experts in
moe.py and the configuration in model_config.py; this module holds the layers around them and
the encoder-decoder assembly (the decoder-only one is in decoder_only.py).

Shapes in names follow the package legend (t2t_jax/__init__.py).
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from t2t_jax import PAD_ID
from t2t_jax.model import moe
from t2t_jax.model import pallas_attention
from t2t_jax.model.attention import attention_mask, self_attention_mask
from t2t_jax.model.attention import CrossAttention, SelfAttention, SelfMask, attention_kinds
from t2t_jax.model.model_config import REMAT_POLICIES, TransformerConfig
from t2t_jax.model.positions import Embedder
from t2t_jax.model.relu_dropout import ReluDropout

Array = jax.Array


def dense_init(names):
  """Xavier-uniform kernels of the dense layers (feed-forward, logits), logically named."""
  return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), names)


def shift_right(targets_BL: Array, segment_ids_BL: Array | None = None) -> Array:
  """Decoder inputs: targets shifted one step right, a 0 (start) at every segment start."""
  shifted = jnp.pad(targets_BL, ((0, 0), (1, 0)))[:, :-1]
  if segment_ids_BL is not None:
    previous = jnp.pad(segment_ids_BL, ((0, 0), (1, 0)))[:, :-1]
    shifted = jnp.where(segment_ids_BL == previous, shifted, 0)
  return shifted


class FeedForward(nn.Module):
  """Position-wise ReLU network with dropout on its hidden activations."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x_BLE: Array) -> Array:
    cfg = self.config
    h_BLF = nn.Dense(cfg.d_ff, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     kernel_init=dense_init(('embed', 'mlp')),
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('mlp',)),
                     name='wi')(x_BLE)
    h_BLF = nn.with_logical_constraint(h_BLF, ('batch', 'length', 'mlp'))
    # nn.Dropout(relu_dropout)(nn.relu(h)), keeping neither mask nor h for the gradient.
    h_BLF = ReluDropout(cfg.relu_dropout, name='Dropout_0')(h_BLF, cfg.deterministic)
    return nn.Dense(cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    kernel_init=dense_init(('mlp', 'embed')),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
                    name='wo')(h_BLF)


class LayerNorm(nn.LayerNorm):
  """LayerNorm with logically named scale and bias."""
  scale_init: Any = nn.with_logical_partitioning(nn.initializers.ones, ('embed',))
  bias_init: Any = nn.with_logical_partitioning(nn.initializers.zeros, ('embed',))


class Sublayer(nn.Module):
  """Residual wrapper: post-LN `LN(x + drop(f(x)))` or pre-LN `x + drop(f(LN(x)))`."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, fn, x_BLE: Array) -> Array:
    cfg = self.config
    norm = LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype, name='norm')
    if cfg.norm == 'pre':
      y_BLE = nn.Dropout(cfg.dropout)(fn(norm(x_BLE)), cfg.deterministic)
      return x_BLE + y_BLE
    y_BLE = nn.Dropout(cfg.dropout)(fn(x_BLE), cfg.deterministic)
    return norm(x_BLE + y_BLE)


def _feed_forward(cfg: TransformerConfig, use_moe: bool, valid_BL: Array | None):
  """The feed-forward sublayer's function: dense, or experts that skip invalid tokens."""
  if not use_moe:
    return FeedForward(cfg, name='ffn')
  experts = moe.MoeFeedForward(cfg, name='moe')
  return lambda x_BLE: experts(x_BLE, valid_BL)


class EncoderLayer(nn.Module):
  config: TransformerConfig
  use_moe: bool = False  # Mixture of experts in place of the feed-forward network.
  attention_kind: str = 'full'  # Of the self-attention: 'full', 'local' or 'compressed'.

  @nn.compact
  def __call__(self, x_BLE: Array, mask: SelfMask, valid_BL: Array | None = None) -> Array:
    cfg = self.config
    attention = SelfAttention(cfg, kind=self.attention_kind,
                              relative=cfg.positions == 'relative', name='self_attention')
    x_BLE = Sublayer(cfg, name='attention_block')(lambda x: attention(x, mask), x_BLE)
    x_BLE = Sublayer(cfg, name='ffn_block')(_feed_forward(cfg, self.use_moe, valid_BL), x_BLE)
    x_BLE = nn.with_logical_constraint(x_BLE, ('batch', 'length', 'embed'))
    return (x_BLE, None) if cfg.scan_layers else x_BLE  # nn.scan wants (carry, output).


class DecoderLayer(nn.Module):
  config: TransformerConfig
  use_moe: bool = False  # Mixture of experts in place of the feed-forward network.
  with_cross_attention: bool = True  # False in the decoder-only model: no encoder to attend.
  attention_kind: str = 'full'  # Of the self-attention: 'full', 'local' or 'compressed'.

  @nn.compact
  def __call__(self, y_BLE, encoded_BKE, self_mask: SelfMask | None, cross_mask_B1LK,
               valid_BL=None):
    cfg = self.config
    self_attention = SelfAttention(cfg, cached=True, kind=self.attention_kind, causal=True,
                                   relative=cfg.positions == 'relative', name='self_attention')
    y_BLE = Sublayer(cfg, name='self_attention_block')(
        lambda y: self_attention(y, self_mask), y_BLE)
    if self.with_cross_attention:
      cross_attention = CrossAttention(cfg, name='cross_attention')
      y_BLE = Sublayer(cfg, name='cross_attention_block')(
          lambda y: cross_attention(y, encoded_BKE, cross_mask_B1LK), y_BLE)
    y_BLE = Sublayer(cfg, name='ffn_block')(_feed_forward(cfg, self.use_moe, valid_BL), y_BLE)
    y_BLE = nn.with_logical_constraint(y_BLE, ('batch', 'length', 'embed'))
    return (y_BLE, None) if cfg.scan_layers else y_BLE  # nn.scan wants (carry, output).


def run_encoder(module: nn.Module, x_BLE: Array, mask: SelfMask, valid_BL: Array) -> Array:
  """`module`'s encoder stack (`encoder_layers`, scanned or a list) over embedded tokens, then
  its final `encoder_norm` under pre-LN: the encoder-decoder's and the encoder-only model's."""
  if module.config.scan_layers:
    x_BLE, _ = module.encoder_layers(x_BLE, mask, valid_BL)
  else:
    for layer in module.encoder_layers:
      x_BLE = layer(x_BLE, mask, valid_BL)
  return module.encoder_norm(x_BLE) if module.config.norm == 'pre' else x_BLE


def remat_layer(layer_class, cfg: TransformerConfig):
  """The layer class, rematerialised in the backward pass as config.model.remat says."""
  if cfg.remat == 'none':
    return layer_class
  # Inside a scan the loop already keeps XLA from merging the recomputation into the forward
  # pass, so the CSE barriers that would otherwise stop it are only overhead.
  return nn.remat(layer_class, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)


def scanned_stack(layer_class, cfg: TransformerConfig, num_layers: int, broadcast: int):
  """One compiled layer applied `num_layers` times, its variables stacked on a 'layers' axis.

  The residual stream is the scan carry; the `broadcast` other arguments (masks, encoder
  output) are the same for every layer. Parameters, decode caches and sown attention weights
  get a leading axis of length `num_layers`.
  """
  return nn.scan(remat_layer(layer_class, cfg),
                 variable_axes={'params': 0, 'cache': 0, 'intermediates': 0, moe.COLLECTION: 0},
                 split_rngs={'params': True, 'dropout': True},
                 in_axes=(nn.broadcast,) * broadcast, length=num_layers,
                 metadata_params={nn.PARTITION_NAME: 'layers'})


def stack_layer_params(params: dict, config: TransformerConfig) -> dict:
  """Unboxed unrolled parameters ('encoder_0', ...) in the scan_layers layout ('encoder_layers')."""
  params = dict(params)
  for stack, count in (('encoder', config.num_encoder_layers),
                       ('decoder', config.num_decoder_layers)):
    if not count:  # The decoder-only model has no encoder.
      continue
    layers = [params.pop(f'{stack}_{i}') for i in range(count)]
    params[f'{stack}_layers'] = jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
  return params


def unstack_layer_params(params: dict, config: TransformerConfig) -> dict:
  """Unboxed scan_layers parameters in the unrolled layout: the inverse of stack_layer_params."""
  params = dict(params)
  for stack, count in (('encoder', config.num_encoder_layers),
                       ('decoder', config.num_decoder_layers)):
    if not count:
      continue
    stacked = params.pop(f'{stack}_layers')
    params.update({f'{stack}_{i}': jax.tree.map(lambda x, i=i: x[i], stacked)
                   for i in range(count)})
  return params


class Embed(nn.Embed):
  """flax's Embed, with a lookup that suits a table split along 'embed' (FSDP).

  Under FSDP the table is split along 'embed' while the looked-up rows are split by batch.
  Where the mesh axes of 'embed' also split the batch and 'vocab' is not split, each device
  looks up, in its own columns of the table, the tokens of every device it shares columns
  with (their ids gathered: a few KB), and an all-to-all hands each device its own rows
  whole (`_lookup_by_columns`): a [tokens, d_model] exchange instead of gathering the whole
  [vocab, d_model] table before the first layer, and in the backward pass the rows' gradients
  come back the same way and are added into the device's own columns, so the lookups leave no
  dense [vocab, d_model] gradient to reduce after the last layer. The tied output softmax
  still gathers the table, where its product needs it.

  Elsewhere (no mesh, a batch the axes do not divide, 'vocab' split) the lookup reads the
  table whole along 'embed' and XLA gathers it (left to split it, XLA's partitioner gathers
  every row to every device for the gradient's scatter: "Involuntary full rematerialization",
  found compiling for 8 H100s). Either way the table is cast to the compute dtype first
  (half the bytes over the links) and the values are the same.
  """

  def __call__(self, inputs: Array) -> Array:
    table_VE = nn.with_logical_constraint(jnp.asarray(self.embedding, self.dtype),
                                          ('vocab', 'embed'))
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
      vocab_axes, embed_axes = nn.logical_to_mesh_axes(('vocab', 'embed'))
      batch_axes = nn.logical_to_mesh_axes(('batch',))[0]
      split = _mesh_axes(embed_axes, mesh)
      batch = _mesh_axes(batch_axes, mesh)
      if (split and not _mesh_axes(vocab_axes, mesh) and set(split) <= set(batch)
          and inputs.ndim and pallas_attention.dividing(batch, inputs.shape[0], mesh)
          and pallas_attention.dividing(split, self.features, mesh)):
        return _lookup_by_columns(table_VE, inputs, split, batch)
    table_VE = nn.with_logical_constraint(table_VE, ('vocab', None))
    return jnp.take(table_VE, inputs, axis=0)


def _mesh_axes(axes, mesh) -> tuple[str, ...]:
  """The mesh axes of a logical axis (None, a name or several) that are larger than 1."""
  names = (axes,) if isinstance(axes, str) else tuple(axes or ())
  return tuple(name for name in names if mesh.shape[name] > 1)


def _lookup_by_columns(table_VE: Array, ids_B: Array, split: tuple[str, ...],
                       batch: tuple[str, ...]) -> Array:
  """Rows of `table_VE` (its columns split over mesh axes `split`) for `ids_B` (its first axis
  split over `batch`, which includes `split`), as described in Embed."""
  rest = (None,) * (ids_B.ndim - 1)

  def on_device(table_Ve, ids_b):
    ids_n = jax.lax.all_gather(ids_b, split, axis=0, tiled=True)  # The column sharers' ids.
    rows_nLe = jnp.take(table_Ve, ids_n, axis=0)
    sharers = rows_nLe.shape[0] // ids_b.shape[0]
    # Exchanged along the major axis, so XLA keeps the rows' usual layout: [sharer, b, L, e]
    # in, [the sharer whose columns, b, L, e] out, then the columns side by side.
    rows_SbLe = jax.lax.all_to_all(rows_nLe.reshape((sharers,) + ids_b.shape + (-1,)), split,
                                   0, 0, tiled=True)
    return jnp.moveaxis(rows_SbLe, 0, -2).reshape(ids_b.shape + (-1,))

  return jax.shard_map(on_device, in_specs=(P(None, split), P(batch, *rest)),
                       out_specs=P(batch, *rest, None))(table_VE, ids_B)


def _embedding(cfg: TransformerConfig, name: str) -> nn.Embed:
  return Embed(
      cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
      embedding_init=nn.with_logical_partitioning(
          nn.initializers.normal(stddev=cfg.d_model**-0.5), ('vocab', 'embed')),
      name=name)


def output_logits(module: nn.Module, y_BLE: Array, float32: bool = True) -> Array:
  """`module`'s output logits for final states [..., E] (any leading axes): the tied target
  embedding or its `output_projection`, as `module.config.tie_output` says; in float32, or
  with `float32=False` in the compute dtype (the chunked loss reads them so and reduces in
  float32: half the bytes of a [tokens, vocab] array in bfloat16).

  The first axis is split like the batch, so a flat [N, E] chunk of tokens stays spread over
  the devices; the vocabulary axis may be split over 'tensor'.
  """
  if module.config.tie_output:
    logits_BLV = module.target_embedding.attend(y_BLE)
  else:
    logits_BLV = module.output_projection(y_BLE)
  names = ('batch',) + ('length',) * (y_BLE.ndim - 2) + ('vocab',)
  logits_BLV = nn.with_logical_constraint(logits_BLV, names)
  return logits_BLV.astype(jnp.float32) if float32 else logits_BLV


def make_embeddings(cfg: TransformerConfig) -> tuple[nn.Embed, nn.Embed]:
  """The target embedding ('embedding', also the tied softmax) and the source one (the same
  module when share_embeddings); called from a model's setup, which owns them."""
  target = _embedding(cfg, 'embedding')
  return target, target if cfg.share_embeddings else _embedding(cfg, 'source_embedding')


class Transformer(nn.Module):
  """Encoder-decoder; `__call__` is teacher forcing, `encode`/`decode` serve generation."""
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.target_embedding, self.source_embedding = make_embeddings(cfg)
    self.source_embedder = Embedder(cfg, self.source_embedding)
    self.target_embedder = Embedder(cfg, self.target_embedding, decode_step=True)
    kinds = attention_kinds(cfg.attention_pattern)  # Repeated over each stack's layers.
    if cfg.scan_layers:
      # One kind only (check_family), and MoE in every layer or none (moe.check).
      self.encoder_layers = scanned_stack(EncoderLayer, cfg, cfg.num_encoder_layers, 2)(
          cfg, use_moe=bool(cfg.moe_experts), attention_kind=kinds[0], name='encoder_layers')
      self.decoder_layers = scanned_stack(DecoderLayer, cfg, cfg.num_decoder_layers, 4)(
          cfg, use_moe=bool(cfg.moe_experts), attention_kind=kinds[0], name='decoder_layers')
    else:
      encoder_layer = remat_layer(EncoderLayer, cfg)
      decoder_layer = remat_layer(DecoderLayer, cfg)
      n_enc, n_dec = cfg.num_encoder_layers, cfg.num_decoder_layers
      self.encoder_layers = [
          encoder_layer(cfg, use_moe=moe.uses_moe(cfg, i, n_enc),
                        attention_kind=kinds[i % len(kinds)], name=f'encoder_{i}')
          for i in range(n_enc)]
      self.decoder_layers = [
          decoder_layer(cfg, use_moe=moe.uses_moe(cfg, i, n_dec),
                        attention_kind=kinds[i % len(kinds)], name=f'decoder_{i}')
          for i in range(n_dec)]
    if cfg.norm == 'pre':
      self.encoder_norm = LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
      self.decoder_norm = LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    if not cfg.tie_output:
      self.output_projection = nn.Dense(
          cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
          kernel_init=dense_init(('embed', 'vocab')))

  def encode(self, inputs_BL: Array, inputs_positions_BL: Array | None = None,
             inputs_segments_BL: Array | None = None) -> Array:
    """Encoder output [B, L, E]; padding (id 0) is masked out of attention."""
    cfg = self.config
    valid_BL = inputs_BL != PAD_ID
    mask = self_attention_mask(valid_BL, inputs_segments_BL, inputs_positions_BL, causal=False,
                               kinds=attention_kinds(cfg.attention_pattern))
    x_BLE = self.source_embedder(inputs_BL, inputs_positions_BL)
    return run_encoder(self, x_BLE, mask, valid_BL)

  def decode(self, encoded_BKE: Array | None, inputs_BK: Array, targets_BL: Array,
             targets_positions_BL: Array | None = None,
             inputs_segments_BK: Array | None = None,
             targets_segments_BL: Array | None = None, return_hidden: bool = False) -> Array:
    """Logits [B, L, V] in float32, or with `return_hidden` the final states [B, L, E].

    In training, `targets_BL` are the gold targets (shifted right here). In decode mode they
    are the previous tokens, one step at a time, and the positions come from the cache;
    `encoded_BKE` is needed on the first step only, after which its projections are cached.
    The hidden states, passed to `output_logits` a chunk at a time, let the loss avoid
    holding all [B, L, V] logits at once.
    """
    cfg = self.config
    inputs_valid_BK = inputs_BK != PAD_ID
    if cfg.decode:
      decoder_inputs_BL = targets_BL
      self_mask = None  # The self-attention cache builds its own.
      valid_BL = None  # Every step's token is real (the start token is a PAD id).
    else:
      decoder_inputs_BL = shift_right(targets_BL, targets_segments_BL)
      valid_BL = targets_BL != PAD_ID  # Positions that predict a real target token.
      self_mask = self_attention_mask(targets_BL != PAD_ID, targets_segments_BL,
                                      targets_positions_BL, causal=True,
                                      kinds=attention_kinds(cfg.attention_pattern))
    cross_mask = attention_mask(inputs_valid_BK, targets_segments_BL, inputs_segments_BK)
    y_BLE = self.target_embedder(decoder_inputs_BL, targets_positions_BL)
    if cfg.scan_layers:
      y_BLE, _ = self.decoder_layers(y_BLE, encoded_BKE, self_mask, cross_mask, valid_BL)
    else:
      for layer in self.decoder_layers:
        y_BLE = layer(y_BLE, encoded_BKE, self_mask, cross_mask, valid_BL)
    if cfg.norm == 'pre':
      y_BLE = self.decoder_norm(y_BLE)
    return y_BLE if return_hidden else self.output_logits(y_BLE)

  def output_logits(self, y_BLE: Array, float32: bool = True) -> Array:
    """Output softmax logits (float32 unless asked not) for final decoder states [..., E]."""
    return output_logits(self, y_BLE, float32)

  def __call__(self, inputs_BK: Array, targets_BL: Array,
               inputs_positions_BK: Array | None = None,
               targets_positions_BL: Array | None = None,
               inputs_segments_BK: Array | None = None,
               targets_segments_BL: Array | None = None, return_hidden: bool = False) -> Array:
    encoded_BKE = self.encode(inputs_BK, inputs_positions_BK, inputs_segments_BK)
    return self.decode(encoded_BKE, inputs_BK, targets_BL, targets_positions_BL,
                       inputs_segments_BK, targets_segments_BL, return_hidden)


def output_matrix(params, config: TransformerConfig) -> Array:
  """The output layer's [V, E] parameter matrix (the logits are y matrix^T, in the compute
  dtype): the tied embedding, or the output kernel transposed."""
  [(name, weights)] = output_params(params, config).items()
  return weights['embedding'] if name == 'embedding' else weights['kernel'].T


def output_params(params, config: TransformerConfig) -> dict:
  """The parameters `Transformer.output_logits` reads: the tied embedding or the output kernel."""
  name = 'embedding' if config.tie_output else 'output_projection'
  return {name: params[name]}
