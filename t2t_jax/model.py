"""The Transformer encoder-decoder of "Attention Is All You Need" in Flax linen.

Shapes in names: B batch, L length (Q queries, K keys), H heads, D head dim, E d_model,
F feed-forward width, V vocabulary.
"""

import dataclasses
import functools
from typing import Any

from absl import logging
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t2t_jax import ConfigError
from t2t_jax import PAD_ID
from t2t_jax import moe

Array = jax.Array
_NEG_INF = -1e9  # Large but finite, so rows with no visible key stay NaN-free.

# config.model.remat -> what the backward pass keeps of each layer (the rest is recomputed).
# 'dots' keeps the outputs of the weight matmuls (projections, feed-forward), most of a
# layer's FLOPs, but not the batched query-key and weight-value products: their [B, H, Q, K]
# operands grow with length squared and they are a few percent of the FLOPs at these widths.
REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Static hyperparameters; `deterministic` and `decode` select the mode."""
  vocab_size: int
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout: float = 0.1
  attention_dropout: float = 0.1
  relu_dropout: float = 0.1
  share_embeddings: bool = True
  tie_output: bool = True
  norm: str = 'post'
  max_len: int = 512
  scan_layers: bool = False
  remat: str = 'none'
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  attention_impl: str = 'einsum'  # Resolved: 'einsum', 'xla' or 'cudnn' (never 'auto').
  kind: str = 'encoder_decoder'  # Or 'decoder_only' (`DecoderOnly`); `make_model` picks.
  prefix_attention: str = 'causal'  # Decoder-only: how the source attends ('causal', 'full').
  moe_experts: int = 0  # Mixture of experts (moe.py); 0: dense feed-forward layers.
  moe_top_k: int = 2
  moe_capacity_factor: float = 1.25
  moe_layers: str = 'every_other'
  deterministic: bool = False
  decode: bool = False

  @classmethod
  def from_config(cls, model_config, vocab_size: int, **overrides) -> 'TransformerConfig':
    """Builds from the `model` section of an ml_collections config."""
    if model_config.d_model % model_config.num_heads:
      raise ConfigError(f'config.model.d_model={model_config.d_model} is not divisible by '
                        f'config.model.num_heads={model_config.num_heads}')
    if model_config.norm not in ('post', 'pre'):
      raise ConfigError(f"config.model.norm must be 'post' or 'pre', got {model_config.norm!r}")
    kwargs = {f.name: model_config[f.name] for f in dataclasses.fields(cls)
              if f.name in model_config}
    kwargs['dtype'] = compute_dtype(kwargs['dtype'], jax.devices()[0].platform)
    kwargs['param_dtype'] = jnp.dtype(kwargs['param_dtype'])
    if kwargs.get('kind', cls.kind) not in MODEL_KINDS:
      raise ConfigError(f'config.model.kind={kwargs["kind"]!r} must be one of {MODEL_KINDS}')
    if kwargs.get('prefix_attention', cls.prefix_attention) not in PREFIX_ATTENTION:
      raise ConfigError(f'config.model.prefix_attention={kwargs["prefix_attention"]!r} must be '
                        f'one of {PREFIX_ATTENTION}')
    if kwargs.get('kind') == 'decoder_only':  # One stack: the encoder's depth does not apply.
      kwargs['num_encoder_layers'] = 0
    kwargs['attention_impl'] = resolve_attention_impl(
        model_config.attention_impl, kwargs['dtype'],
        model_config.d_model // model_config.num_heads, model_config.attention_dropout,
        jax.devices()[0].platform)
    config = cls(vocab_size=vocab_size, **{**kwargs, **overrides})
    # Checked on the result: configs saved before the key existed lack it and mean 'none'.
    if config.remat not in REMAT_POLICIES:
      raise ConfigError(f'config.model.remat must be one of {", ".join(map(repr, REMAT_POLICIES))}'
                        f', got {config.remat!r}')
    moe.check(config)
    return config


MODEL_KINDS = ('encoder_decoder', 'decoder_only')  # config.model.kind
PREFIX_ATTENTION = ('causal', 'full')  # config.model.prefix_attention


def compute_dtype(name: str, platform: str):
  """config.model.dtype as a dtype; 'auto' is bfloat16 on accelerators, float32 on CPU."""
  if name == 'auto':
    return jnp.dtype(jnp.float32 if platform == 'cpu' else jnp.bfloat16)
  if name not in ('float32', 'bfloat16', 'float16'):
    raise ConfigError(f"config.model.dtype={name!r} must be 'float32', 'bfloat16', 'float16' "
                      "or 'auto'")
  return jnp.dtype(name)


ATTENTION_IMPLS = ('auto', 'einsum', 'xla', 'cudnn')


def resolve_attention_impl(impl: str, dtype, head_dim: int, attention_dropout: float,
                           platform: str) -> str:
  """The attention implementation to run: 'auto' picks the fastest verified one.

  'einsum' is the explicit softmax(QK^T)V with dropout on the weights; 'xla' and 'cudnn' go
  through `jax.nn.dot_product_attention` (cuDNN's fused flash attention on NVIDIA GPUs in
  bfloat16/float16 with head sizes up to 128 in multiples of 8). Neither fused one applies
  dropout to the attention weights, so they need config.model.attention_dropout=0. 'xla'
  runs the same arithmetic as 'einsum' (measured equal on CPU), so 'auto' is 'einsum' until
  cuDNN passes the equality test on a GPU (README, "Performance"); it logs why once.
  """
  if impl not in ATTENTION_IMPLS:
    raise ConfigError(f'config.model.attention_impl={impl!r} must be one of {ATTENTION_IMPLS}')
  cudnn_problem = (
      f'the platform is {platform}, not gpu' if platform != 'gpu' else
      f'config.model.dtype={jnp.dtype(dtype).name}, not bfloat16 or float16'
      if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) else
      f'the head size {head_dim} is not a multiple of 8 up to 128'
      if head_dim % 8 or head_dim > 128 else None)
  dropout_problem = (f'config.model.attention_dropout={attention_dropout} is not 0, and fused '
                     'attention has no dropout on its weights' if attention_dropout else None)
  if impl == 'auto':
    why_not = dropout_problem or cudnn_problem or (
        'cuDNN attention applies, but on an H100 with jax 0.11.2 it failed the equality test '
        "against einsum and was no faster at 64-token rows, so only an explicit 'cudnn' runs it")
    _log_once(f"config.model.attention_impl='auto' uses 'einsum' attention: {why_not}.")
    return 'einsum'
  problem = dropout_problem if impl != 'einsum' else None
  if impl == 'cudnn':
    problem = problem or cudnn_problem
  if problem:
    raise ConfigError(f'config.model.attention_impl={impl!r} cannot run: {problem}. Use '
                      "'auto' (which falls back) or change the setting named.")
  return impl


@functools.cache
def _log_once(message: str) -> None:
  logging.info('%s', message)


def sinusoidal_positions(max_len: int, d_model: int) -> np.ndarray:
  """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(same), as in the paper."""
  position = np.arange(max_len)[:, None]
  div = np.power(10000.0, np.arange(0, d_model, 2) / d_model)[None, :]
  table = np.zeros((max_len, d_model), np.float32)
  table[:, 0::2] = np.sin(position / div)
  table[:, 1::2] = np.cos(position / div)[:, :d_model // 2]
  return table


def shift_right(targets_BL: Array, segment_ids_BL: Array | None = None) -> Array:
  """Decoder inputs: targets shifted one step right, a 0 (start) at every segment start."""
  shifted = jnp.pad(targets_BL, ((0, 0), (1, 0)))[:, :-1]
  if segment_ids_BL is not None:
    previous = jnp.pad(segment_ids_BL, ((0, 0), (1, 0)))[:, :-1]
    shifted = jnp.where(segment_ids_BL == previous, shifted, 0)
  return shifted


def attention_mask(key_valid_BK: Array, query_segments_BQ: Array | None = None,
                   key_segments_BK: Array | None = None, causal: bool = False) -> Array:
  """Boolean mask broadcastable to [B, 1, Q, K]: padded keys, other segments, later positions.

  Built once per batch, [B, 1, 1, K] when only padding matters. Padding queries are not
  masked: their outputs are never used, and a query (packed padding, segment 0) that sees
  some key keeps every softmax row well defined for the fused kernels.
  """
  mask_B11K = key_valid_BK[:, None, None, :]
  if query_segments_BQ is None and not causal:
    return mask_B11K
  mask_B1QK = mask_B11K
  if query_segments_BQ is not None:
    same_BQK = ((query_segments_BQ[:, :, None] == key_segments_BK[:, None, :])
                | (query_segments_BQ[:, :, None] == 0))
    mask_B1QK = mask_B1QK & same_BQK[:, None]
  if causal:
    length = key_valid_BK.shape[1]
    mask_B1QK = mask_B1QK & jnp.tril(jnp.ones((length, length), bool))[None, None]
  return mask_B1QK


def _dense_init(names):
  return nn.with_logical_partitioning(nn.initializers.xavier_uniform(), names)


class MultiHeadAttention(nn.Module):
  """Scaled dot-product attention with decode-mode caches.

  In decode mode self-attention keeps a key/value cache of the tokens so far, and
  cross-attention projects the encoder output to keys/values on its first call only and
  reads them from the cache afterwards (`memory_BKE` may then be None).
  """
  config: TransformerConfig
  self_attention_cache: bool = False
  memory_cache: bool = False  # Decoder cross-attention: cache the projected encoder output.

  @nn.compact
  def __call__(self, x_BQE: Array, memory_BKE: Array | None, mask_B1QK: Array | None) -> Array:
    cfg = self.config
    head_dim = cfg.d_model // cfg.num_heads
    def kernel(name, shape, names, in_axis, out_axis):
      init = nn.initializers.xavier_uniform(in_axis=in_axis, out_axis=out_axis)
      return self.param(name, nn.with_logical_partitioning(init, names), shape,
                        cfg.param_dtype).astype(cfg.dtype)

    qkv_shape, qkv_names = (cfg.d_model, cfg.num_heads, head_dim), ('embed', 'heads', 'kv')
    def project(name, y_BKE, layout='BKHD'):
      return jnp.einsum(f'BKE,EHD->{layout}', y_BKE.astype(cfg.dtype),
                        kernel(name, qkv_shape, qkv_names, 0, (1, 2)))

    q_BQHD = project('query', x_BQE) * head_dim**-0.5
    q_BQHD = nn.with_logical_constraint(q_BQHD, ('batch', 'length', 'heads', 'kv'))
    if cfg.decode and (self.memory_cache or self.self_attention_cache):
      return self._cached_attention(q_BQHD, memory_BKE, mask_B1QK, project, kernel)
    k_BKHD, v_BKHD = project('key', memory_BKE), project('value', memory_BKE)

    if cfg.attention_impl == 'einsum':
      logits_BHQK = jnp.einsum('BQHD,BKHD->BHQK', q_BQHD, k_BKHD).astype(jnp.float32)
      if mask_B1QK is not None:
        logits_BHQK = jnp.where(mask_B1QK, logits_BHQK, _NEG_INF)
      weights_BHQK = jax.nn.softmax(logits_BHQK).astype(cfg.dtype)
      self.sow('intermediates', 'attention_weights', weights_BHQK)
      weights_BHQK = nn.Dropout(cfg.attention_dropout)(weights_BHQK, cfg.deterministic)
      out_BQHD = jnp.einsum('BHQK,BKHD->BQHD', weights_BHQK, v_BKHD)
    else:
      # One query per decoding step is no work for a flash kernel: XLA's path serves it.
      impl = 'xla' if cfg.decode else cfg.attention_impl
      if impl == 'cudnn' and mask_B1QK is not None:  # cuDNN takes it as a [.., Q, K] bias.
        mask_B1QK = jnp.broadcast_to(mask_B1QK, mask_B1QK.shape[:2] + (q_BQHD.shape[1],
                                                                       k_BKHD.shape[1]))
      out_BQHD = jax.nn.dot_product_attention(q_BQHD, k_BKHD, v_BKHD, mask=mask_B1QK,
                                              scale=1.0, implementation=impl)
    w_out_HDE = kernel('out', (cfg.num_heads, head_dim, cfg.d_model), ('heads', 'kv', 'embed'),
                       (0, 1), 2)
    return jnp.einsum('BQHD,HDE->BQE', out_BQHD, w_out_HDE)

  def _cached_attention(self, q_BQHD, memory_BKE, mask_B1QK, project, kernel) -> Array:
    """One decoding step against the cache, kept heads-major ([B, H, K, D]).

    Heads-major is the layout the query-key and weight-value products read: stored
    [B, K, H, D], every step would transpose the whole cache of every layer first.
    """
    cfg = self.config
    if self.memory_cache:
      # The init function runs only while the cache lacks the entry: once per batch.
      k_BHKD = self.variable('cache', 'memory_key', project, 'key', memory_BKE, 'BHKD').value
      v_BHKD = self.variable('cache', 'memory_value', project, 'value', memory_BKE,
                             'BHKD').value
    else:
      k_BHKD, v_BHKD, mask_B1QK = self._update_cache(project('key', memory_BKE, 'BHKD'),
                                                     project('value', memory_BKE, 'BHKD'),
                                                     mask_B1QK)
    logits_BHQK = jnp.einsum('BQHD,BHKD->BHQK', q_BQHD, k_BHKD).astype(jnp.float32)
    if mask_B1QK is not None:
      logits_BHQK = jnp.where(mask_B1QK, logits_BHQK, _NEG_INF)
    weights_BHQK = jax.nn.softmax(logits_BHQK).astype(cfg.dtype)
    self.sow('intermediates', 'attention_weights', weights_BHQK)
    out_BQHD = jnp.einsum('BHQK,BHKD->BQHD', weights_BHQK, v_BHKD)
    head_dim = cfg.d_model // cfg.num_heads
    w_out_HDE = kernel('out', (cfg.num_heads, head_dim, cfg.d_model), ('heads', 'kv', 'embed'),
                       (0, 1), 2)
    return jnp.einsum('BQHD,HDE->BQE', out_BQHD, w_out_HDE)

  def _update_cache(self, k_BHQD, v_BHQD, mask_B1QK):
    """Writes this call's keys/values from the cache index on; returns the whole cache and mask.

    A call writes one token (a decoding step) or several (a decoder-only model's prompt, in
    one pass). Each query sees the keys up to its own, except that a given `mask_B1QK`
    decides for the first `mask_B1QK.shape[-1]` keys of the cache.
    """
    initialised = self.has_variable('cache', 'key')
    key = self.variable('cache', 'key', jnp.zeros, k_BHQD.shape, k_BHQD.dtype)
    value = self.variable('cache', 'value', jnp.zeros, v_BHQD.shape, v_BHQD.dtype)
    index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))
    if not initialised:  # The init call only sizes the cache, from a full-length input.
      return k_BHQD, v_BHQD, mask_B1QK
    i, length = index.value, k_BHQD.shape[2]
    key.value = jax.lax.dynamic_update_slice(key.value, k_BHQD, (0, 0, i, 0))
    value.value = jax.lax.dynamic_update_slice(value.value, v_BHQD, (0, 0, i, 0))
    index.value = i + length
    max_len = key.value.shape[2]
    causal_11QK = (jnp.arange(max_len)[None, :] <= i + jnp.arange(length)[:, None])[None, None]
    if mask_B1QK is None:
      return key.value, value.value, causal_11QK
    # A decoder-only model's mask over its prompt, the first keys: it knows which are padding
    # and whether the prompt attends among itself in full. Later keys stay causal.
    rows, prompt = mask_B1QK.shape[0], mask_B1QK.shape[-1]
    later_B1QK = jnp.broadcast_to(causal_11QK[..., prompt:],
                                  (rows, 1, length, max_len - prompt))
    mask_B1QK = jnp.broadcast_to(mask_B1QK, (rows, 1, length, prompt))
    return key.value, value.value, jnp.concatenate([mask_B1QK, later_B1QK], axis=-1)


class FeedForward(nn.Module):
  """Position-wise ReLU network with dropout on its hidden activations."""
  config: TransformerConfig

  @nn.compact
  def __call__(self, x_BLE: Array) -> Array:
    cfg = self.config
    h_BLF = nn.Dense(cfg.d_ff, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                     kernel_init=_dense_init(('embed', 'mlp')),
                     bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ('mlp',)),
                     name='wi')(x_BLE)
    h_BLF = nn.with_logical_constraint(nn.relu(h_BLF), ('batch', 'length', 'mlp'))
    h_BLF = nn.Dropout(cfg.relu_dropout)(h_BLF, cfg.deterministic)
    return nn.Dense(cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    kernel_init=_dense_init(('mlp', 'embed')),
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

  @nn.compact
  def __call__(self, x_BLE: Array, mask_B1LL: Array, valid_BL: Array | None = None) -> Array:
    cfg = self.config
    attention = MultiHeadAttention(cfg, name='self_attention')
    x_BLE = Sublayer(cfg, name='attention_block')(lambda x: attention(x, x, mask_B1LL), x_BLE)
    x_BLE = Sublayer(cfg, name='ffn_block')(_feed_forward(cfg, self.use_moe, valid_BL), x_BLE)
    x_BLE = nn.with_logical_constraint(x_BLE, ('batch', 'length', 'embed'))
    return (x_BLE, None) if cfg.scan_layers else x_BLE  # nn.scan wants (carry, output).


class DecoderLayer(nn.Module):
  config: TransformerConfig
  use_moe: bool = False  # Mixture of experts in place of the feed-forward network.
  with_cross_attention: bool = True  # False in the decoder-only model: no encoder to attend.

  @nn.compact
  def __call__(self, y_BLE, encoded_BKE, self_mask_B1LL, cross_mask_B1LK, valid_BL=None):
    cfg = self.config
    self_attention = MultiHeadAttention(cfg, self_attention_cache=True, name='self_attention')
    y_BLE = Sublayer(cfg, name='self_attention_block')(
        lambda y: self_attention(y, y, self_mask_B1LL), y_BLE)
    if self.with_cross_attention:
      cross_attention = MultiHeadAttention(cfg, memory_cache=True, name='cross_attention')
      y_BLE = Sublayer(cfg, name='cross_attention_block')(
          lambda y: cross_attention(y, encoded_BKE, cross_mask_B1LK), y_BLE)
    y_BLE = Sublayer(cfg, name='ffn_block')(_feed_forward(cfg, self.use_moe, valid_BL), y_BLE)
    y_BLE = nn.with_logical_constraint(y_BLE, ('batch', 'length', 'embed'))
    return (y_BLE, None) if cfg.scan_layers else y_BLE  # nn.scan wants (carry, output).


class Embedder(nn.Module):
  """Token embedding times sqrt(d_model) plus sinusoidal positions, then dropout."""
  config: TransformerConfig
  embedding: nn.Embed
  decode_step: bool = False  # Decoder side: in decode mode, one position per call.

  @nn.compact
  def __call__(self, tokens_BL: Array, positions_BL: Array | None = None) -> Array:
    cfg = self.config
    x_BLE = self.embedding(tokens_BL) * jnp.sqrt(cfg.d_model).astype(cfg.dtype)
    table_LE = jnp.asarray(sinusoidal_positions(cfg.max_len, cfg.d_model), cfg.dtype)
    if cfg.decode and self.decode_step:
      pos_BLE = jax.lax.dynamic_slice_in_dim(table_LE, self._decode_position(), 1)[None]
    elif positions_BL is not None:
      pos_BLE = table_LE[positions_BL]
    else:
      pos_BLE = table_LE[None, :tokens_BL.shape[1]]
    # A zero added here when 'perturbations' is mutable exposes d(output)/d(embedding).
    x_BLE = self.perturb('embedded', x_BLE + pos_BLE)
    x_BLE = nn.Dropout(cfg.dropout)(x_BLE, cfg.deterministic)
    return nn.with_logical_constraint(x_BLE, ('batch', 'length', 'embed'))

  def _decode_position(self) -> Array:
    """Index of the step being decoded, counted alongside the attention caches."""
    initialised = self.has_variable('cache', 'position')
    position = self.variable('cache', 'position', lambda: jnp.array(0, jnp.int32))
    current = position.value
    if initialised:
      position.value = current + 1
    return current


def _remat(layer_class, cfg: TransformerConfig):
  """The layer class, rematerialised in the backward pass as config.model.remat says."""
  if cfg.remat == 'none':
    return layer_class
  # Inside a scan the loop already keeps XLA from merging the recomputation into the forward
  # pass, so the CSE barriers that would otherwise stop it are only overhead.
  return nn.remat(layer_class, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers)


def _stack(layer_class, cfg: TransformerConfig, num_layers: int, broadcast: int):
  """One compiled layer applied `num_layers` times, its variables stacked on a 'layers' axis.

  The residual stream is the scan carry; the `broadcast` other arguments (masks, encoder
  output) are the same for every layer. Parameters, decode caches and sown attention weights
  get a leading axis of length `num_layers`.
  """
  return nn.scan(_remat(layer_class, cfg),
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


def _embed(cfg: TransformerConfig, name: str) -> nn.Embed:
  return nn.Embed(
      cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
      embedding_init=nn.with_logical_partitioning(
          nn.initializers.normal(stddev=cfg.d_model**-0.5), ('vocab', 'embed')),
      name=name)


class Transformer(nn.Module):
  """Encoder-decoder; `__call__` is teacher forcing, `encode`/`decode` serve generation."""
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.target_embedding = _embed(cfg, 'embedding')
    self.source_embedding = (self.target_embedding if cfg.share_embeddings
                             else _embed(cfg, 'source_embedding'))
    self.source_embedder = Embedder(cfg, self.source_embedding)
    self.target_embedder = Embedder(cfg, self.target_embedding, decode_step=True)
    if cfg.scan_layers:
      # moe.check allows scanned MoE stacks only with every layer an MoE layer.
      self.encoder_layers = _stack(EncoderLayer, cfg, cfg.num_encoder_layers, broadcast=2)(
          cfg, use_moe=bool(cfg.moe_experts), name='encoder_layers')
      self.decoder_layers = _stack(DecoderLayer, cfg, cfg.num_decoder_layers, broadcast=4)(
          cfg, use_moe=bool(cfg.moe_experts), name='decoder_layers')
    else:
      encoder_layer, decoder_layer = _remat(EncoderLayer, cfg), _remat(DecoderLayer, cfg)
      n_enc, n_dec = cfg.num_encoder_layers, cfg.num_decoder_layers
      self.encoder_layers = [encoder_layer(cfg, moe.uses_moe(cfg, i, n_enc), name=f'encoder_{i}')
                             for i in range(n_enc)]
      self.decoder_layers = [decoder_layer(cfg, moe.uses_moe(cfg, i, n_dec), name=f'decoder_{i}')
                             for i in range(n_dec)]
    if cfg.norm == 'pre':
      self.encoder_norm = LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
      self.decoder_norm = LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    if not cfg.tie_output:
      self.output_projection = nn.Dense(
          cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
          kernel_init=_dense_init(('embed', 'vocab')))

  def encode(self, inputs_BL: Array, inputs_positions_BL: Array | None = None,
             inputs_segments_BL: Array | None = None) -> Array:
    """Encoder output [B, L, E]; padding (id 0) is masked out of attention."""
    cfg = self.config
    valid_BL = inputs_BL != PAD_ID
    mask = attention_mask(valid_BL, inputs_segments_BL, inputs_segments_BL)
    x_BLE = self.source_embedder(inputs_BL, inputs_positions_BL)
    if cfg.scan_layers:
      x_BLE, _ = self.encoder_layers(x_BLE, mask, valid_BL)
    else:
      for layer in self.encoder_layers:
        x_BLE = layer(x_BLE, mask, valid_BL)
    return self.encoder_norm(x_BLE) if cfg.norm == 'pre' else x_BLE

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
      self_mask = attention_mask(targets_BL != PAD_ID, targets_segments_BL, targets_segments_BL,
                                 causal=True)
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

  def output_logits(self, y_BLE: Array) -> Array:
    """Output softmax logits in float32 for final decoder states [..., E] (any leading axes).

    The first axis is split like the batch, so a flat [N, E] chunk of tokens stays spread
    over the devices; the vocabulary axis may be split over 'tensor'.
    """
    if self.config.tie_output:
      logits_BLV = self.target_embedding.attend(y_BLE)
    else:
      logits_BLV = self.output_projection(y_BLE)
    names = ('batch',) + ('length',) * (y_BLE.ndim - 2) + ('vocab',)
    logits_BLV = nn.with_logical_constraint(logits_BLV, names)
    return logits_BLV.astype(jnp.float32)

  def __call__(self, inputs_BK: Array, targets_BL: Array,
               inputs_positions_BK: Array | None = None,
               targets_positions_BL: Array | None = None,
               inputs_segments_BK: Array | None = None,
               targets_segments_BL: Array | None = None, return_hidden: bool = False) -> Array:
    encoded_BKE = self.encode(inputs_BK, inputs_positions_BK, inputs_segments_BK)
    return self.decode(encoded_BKE, inputs_BK, targets_BL, targets_positions_BL,
                       inputs_segments_BK, targets_segments_BL, return_hidden)


def output_params(params, config: TransformerConfig) -> dict:
  """The parameters `Transformer.output_logits` reads: the tied embedding or the output kernel."""
  name = 'embedding' if config.tie_output else 'output_projection'
  return {name: params[name]}


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

  Decoding: `prefill` runs the (right-padded) sources through the stack once, filling every
  layer's cache at indices [0, S); `decode` then adds one token per call at index S, S + 1,
  ..., its position the row's source length plus the steps so far, padding keys masked.
  """
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.target_embedding = _embed(cfg, 'embedding')
    self.source_embedding = (self.target_embedding if cfg.share_embeddings
                             else _embed(cfg, 'source_embedding'))
    self.source_embedder = Embedder(cfg, self.source_embedding)
    self.target_embedder = Embedder(cfg, self.target_embedding)
    if cfg.scan_layers:  # moe.check allows scanned MoE stacks only with every layer MoE.
      self.decoder_layers = _stack(DecoderLayer, cfg, cfg.num_decoder_layers, broadcast=4)(
          cfg, use_moe=bool(cfg.moe_experts), with_cross_attention=False, name='decoder_layers')
    else:
      layers = cfg.num_decoder_layers
      self.decoder_layers = [_remat(DecoderLayer, cfg)(
          cfg, moe.uses_moe(cfg, i, layers), with_cross_attention=False, name=f'decoder_{i}')
                             for i in range(layers)]
    if cfg.norm == 'pre':
      self.decoder_norm = LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    if not cfg.tie_output:
      self.output_projection = nn.Dense(
          cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
          kernel_init=_dense_init(('embed', 'vocab')))
    if cfg.decode:  # The cache index the next token goes to, shared by all rows.
      self.cache_index = self.variable('cache', 'index', lambda: jnp.array(0, jnp.int32))

  def _layers(self, x_BLE: Array, mask_B1QK: Array, valid_BL: Array | None) -> Array:
    """The stack (no encoder output, no cross-attention); `valid_BL`: real tokens, for experts."""
    cfg = self.config
    if cfg.scan_layers:
      x_BLE, _ = self.decoder_layers(x_BLE, None, mask_B1QK, None, valid_BL)
    else:
      for layer in self.decoder_layers:
        x_BLE = layer(x_BLE, None, mask_B1QK, None, valid_BL)
    return self.decoder_norm(x_BLE) if cfg.norm == 'pre' else x_BLE

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
    mask = prefix_lm_mask(valid_BL, source_length, segments_BL,
                          cfg.prefix_attention == 'full')
    y_BLE = self._layers(x_BLE, mask, valid_BL)[:, source_length:]
    return y_BLE if return_hidden else self.output_logits(y_BLE)

  def prefill(self, inputs_BS: Array) -> None:
    """Decode mode: the sources' keys and values into every layer's cache, in one pass."""
    cfg = self.config
    self._next_index(inputs_BS.shape[1])
    valid_BS = inputs_BS != PAD_ID
    self._layers(self.source_embedder(inputs_BS),
                 prefix_lm_mask(valid_BS, inputs_BS.shape[1], None,
                                cfg.prefix_attention == 'full'), valid_BS)

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
    prompt_mask_B11S = (jnp.arange(inputs_BS.shape[1]) < length_B1)[:, None, None, :]
    y_BLE = self._layers(y_BLE, prompt_mask_B11S, None)  # Every step's token is real.
    return y_BLE if return_hidden else self.output_logits(y_BLE)

  def _next_index(self, count: int) -> Array:
    """The cache index the next `count` tokens are written from; advances it by `count`."""
    current = self.cache_index.value
    self.cache_index.value = current + count
    return current

  def output_logits(self, y_BLE: Array) -> Array:
    """Output softmax logits in float32 for final states [..., E]; see `Transformer`."""
    if self.config.tie_output:
      logits_BLV = self.target_embedding.attend(y_BLE)
    else:
      logits_BLV = self.output_projection(y_BLE)
    names = ('batch',) + ('length',) * (y_BLE.ndim - 2) + ('vocab',)
    logits_BLV = nn.with_logical_constraint(logits_BLV, names)
    return logits_BLV.astype(jnp.float32)
