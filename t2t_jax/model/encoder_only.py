"""The encoder-only Transformer (BERT, Devlin et al. 2019): one bidirectional stack, its own
embeddings, optional token-type (segment) embeddings, a pooler and one head.

`config.head` names the head: 'mlm' (masked-language-model pre-training: a transform and the
tied output softmax, scored at the chosen positions only; with `next_sentence` also BERT's
next-sentence prediction from the pooled [CLS] state), 'electra' (ELECTRA's replaced-token
detection, Clark et al. 2020: a small generator, `generator_layers` layers over the shared
embeddings under the same masked-LM head, proposes tokens for the chosen positions, and the
encoder, the discriminator, says of every token whether it was replaced), 'classification'
(`num_labels` logits from the pooled state) or 'regression' (one number). A fine-tuning run
has the same encoder, embeddings and pooler as the pre-training run it starts from, and a
fresh head (checkpoints/partial_init.py copies what both have).

Token types are not a batch field: a row reads `[CLS] text [SEP] text2 EOS`, so a token's type
is 1 after the row's first [SEP] and 0 before (data/classification.py writes the rows). In a
packed row (pre-training) each segment counts its own [SEP]s.

Shapes in names follow the package legend (t2t_jax/__init__.py); C is the number of labels.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from t2t_jax import PAD_ID
from t2t_jax.model import moe
from t2t_jax.model.attention import attention_kinds, self_attention_mask
from t2t_jax.model.model_config import PRETRAINING_HEADS, TransformerConfig
from t2t_jax.model.positions import Embedder
from t2t_jax.model.transformer import EncoderLayer, LayerNorm, dense_init, make_embeddings
from t2t_jax.model.transformer import output_logits, remat_layer, run_encoder, scanned_stack

Array = jax.Array

SEP_ID = 4  # tokenizer.SEP_ID: the model may not import the data package.


def token_types(tokens_BL: Array, segments_BL: Array | None) -> Array:
  """0 up to and including a row's (or packed segment's) first [SEP], 1 after it."""
  is_sep_BL = (tokens_BL == SEP_ID).astype(jnp.int32)
  seps_before_BL = jnp.cumsum(is_sep_BL, axis=1) - is_sep_BL
  if segments_BL is not None:  # Count within each segment: subtract the earlier segments'.
    start_BL = segments_BL != jnp.pad(segments_BL, ((0, 0), (1, 0)))[:, :-1]
    offset_BL = jax.lax.cummax(jnp.where(start_BL, seps_before_BL, 0), axis=1)
    seps_before_BL = seps_before_BL - offset_BL
  return (seps_before_BL > 0).astype(jnp.int32)


class EncoderOnly(nn.Module):
  """BERT's assembly from the family's layers; `__call__` runs the configured head."""
  config: TransformerConfig

  def setup(self):
    cfg = self.config
    self.target_embedding, _ = make_embeddings(cfg)  # The output softmax ties to it.
    self.embedder = Embedder(cfg, self.target_embedding)
    if cfg.type_vocab_size:
      self.type_embedding = nn.Embed(
          cfg.type_vocab_size, cfg.d_model, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
          embedding_init=nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02),
                                                      (None, 'embed')))
    kinds = attention_kinds(cfg.attention_pattern)
    if cfg.scan_layers:
      self.encoder_layers = scanned_stack(EncoderLayer, cfg, cfg.num_encoder_layers, 2)(
          cfg, use_moe=bool(cfg.moe_experts), attention_kind=kinds[0], name='encoder_layers')
    else:
      layers = cfg.num_encoder_layers
      self.encoder_layers = [remat_layer(EncoderLayer, cfg)(
          cfg, use_moe=moe.uses_moe(cfg, i, layers), attention_kind=kinds[i % len(kinds)],
          name=f'encoder_{i}') for i in range(layers)]
    if cfg.norm == 'pre':
      self.encoder_norm = LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
    if cfg.head == 'electra':  # The generator: its own layers; embeddings and MLM head below.
      self.generator_layers = [remat_layer(EncoderLayer, cfg)(
          cfg, use_moe=False, attention_kind=kinds[i % len(kinds)], name=f'generator_{i}')
          for i in range(cfg.generator_layers)]
      if cfg.norm == 'pre':
        self.generator_norm = LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
      self.replaced_transform = self._dense(cfg.d_model, 'replaced_transform')
      self.replaced_output = self._dense(1, 'replaced_output', out_axis=None)
    if cfg.head in PRETRAINING_HEADS:
      self.mlm_transform = self._dense(cfg.d_model, 'mlm_transform')
      self.mlm_norm = LayerNorm(dtype=cfg.dtype, param_dtype=cfg.param_dtype)
      self.mlm_bias = self.param('mlm_bias', nn.with_logical_partitioning(
          nn.initializers.zeros, ('vocab',)), (cfg.vocab_size,), cfg.param_dtype)
      if cfg.next_sentence:  # BERT's second objective: the pooled [CLS] state, two logits.
        self.pooler = self._dense(cfg.d_model, 'pooler')
        self.next_sentence = self._dense(2, 'next_sentence', out_axis=None)
      if not cfg.tie_output:
        self.output_projection = nn.Dense(
            cfg.vocab_size, use_bias=False, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
            kernel_init=dense_init(('embed', 'vocab')))
    else:
      self.pooler = self._dense(cfg.d_model, 'pooler')
      self.head_dropout = nn.Dropout(cfg.dropout)
      self.classifier = self._dense(cfg.num_labels if cfg.head == 'classification' else 1,
                                    'classifier', out_axis=None)

  def _dense(self, features: int, name: str, out_axis: str | None = 'mlp') -> nn.Dense:
    """A dense layer from the residual width; a square one names its output 'mlp' (one
    array may not name 'embed' twice)."""
    cfg = self.config
    return nn.Dense(features, dtype=cfg.dtype, param_dtype=cfg.param_dtype,
                    kernel_init=dense_init(('embed', out_axis)),
                    bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (out_axis,)),
                    name=name)

  def _embed(self, tokens_BL: Array, positions_BL: Array | None,
             segments_BL: Array | None) -> tuple[Array, Any, Array]:
    """(embedded tokens [B, L, E], the self-attention mask, real tokens [B, L]): padding
    (id 0) is masked out of attention and packed segments see only themselves."""
    cfg = self.config
    valid_BL = tokens_BL != PAD_ID
    mask = self_attention_mask(valid_BL, segments_BL, positions_BL, causal=False,
                               kinds=attention_kinds(cfg.attention_pattern))
    x_BLE = self.embedder(tokens_BL, positions_BL)
    if cfg.type_vocab_size:
      x_BLE = x_BLE + self.type_embedding(token_types(tokens_BL, segments_BL))
    return x_BLE, mask, valid_BL

  def encode(self, tokens_BL: Array, positions_BL: Array | None = None,
             segments_BL: Array | None = None) -> Array:
    """Final states [B, L, E] of every token of the encoder (ELECTRA's discriminator)."""
    return run_encoder(self, *self._embed(tokens_BL, positions_BL, segments_BL))

  def generate(self, tokens_BL: Array, positions_BL: Array | None = None,
               segments_BL: Array | None = None) -> Array:
    """ELECTRA's generator: final states [B, L, E] of its own layers over the shared
    embeddings; `mlm_logits` reads them."""
    x_BLE, mask, valid_BL = self._embed(tokens_BL, positions_BL, segments_BL)
    for layer in self.generator_layers:
      x_BLE = layer(x_BLE, mask, valid_BL)
    return self.generator_norm(x_BLE) if self.config.norm == 'pre' else x_BLE

  def replaced_logits(self, states_BLE: Array) -> Array:
    """ELECTRA's discriminator head: a logit [B, L] (float32) per token that it was
    replaced, from a GELU transform of the token's final state."""
    hidden_BLE = nn.gelu(self.replaced_transform(states_BLE))
    return self.replaced_output(hidden_BLE)[..., 0].astype(jnp.float32)

  def mlm_logits(self, states_BKE: Array, float32: bool = True) -> Array:
    """Masked-LM logits [B, K, V] of the states at chosen positions: a GELU transform and a
    layer norm (BERT's), then the tied output softmax plus a bias per token."""
    hidden_BKE = self.mlm_norm(nn.gelu(self.mlm_transform(states_BKE)))
    logits_BKV = output_logits(self, hidden_BKE, float32=False)
    logits_BKV = logits_BKV + self.mlm_bias.astype(logits_BKV.dtype)
    return logits_BKV.astype(jnp.float32) if float32 else logits_BKV

  def next_sentence_logits(self, states_BLE: Array) -> Array:
    """Is-next / not-next logits [B, L, 2] (float32) of every position's state through the
    pooler; the objective reads them at each packed segment's [CLS] only."""
    return self.next_sentence(jnp.tanh(self.pooler(states_BLE))).astype(jnp.float32)

  def pool(self, states_BLE: Array, tokens_BL: Array) -> Array:
    """The row's summary [B, E]: its first ([CLS]) token's state or the mean over its real
    tokens (config.model.pooling), through the pooler's dense layer and tanh."""
    if self.config.pooling == 'mean':
      valid_BL1 = (tokens_BL != PAD_ID)[..., None].astype(states_BLE.dtype)
      summary_BE = (states_BLE * valid_BL1).sum(1) / jnp.maximum(valid_BL1.sum(1), 1.0)
    else:
      summary_BE = states_BLE[:, 0]
    return jnp.tanh(self.pooler(summary_BE))

  def head_outputs(self, tokens_BL: Array) -> Array:
    """The task head of one unpacked row per example: logits [B, C] (classification) or
    values [B, 1] (regression), in float32."""
    cfg = self.config
    pooled_BE = self.pool(self.encode(tokens_BL), tokens_BL)
    pooled_BE = self.head_dropout(pooled_BE, cfg.deterministic)
    return self.classifier(pooled_BE).astype(jnp.float32)

  def __call__(self, inputs_BK: Array, targets_BL: Array,
               inputs_positions_BK: Array | None = None,
               targets_positions_BL: Array | None = None,
               inputs_segments_BK: Array | None = None,
               targets_segments_BL: Array | None = None) -> Array:
    """The head on a batch as the pipeline gives it (for `init` and direct use): masked-LM
    logits [B, L, V] of every target token (the text; the objective scores chosen positions
    only, training/encoder_tasks.py; ELECTRA's generator's), or the classifier's outputs of
    the inputs."""
    del inputs_positions_BK, inputs_segments_BK
    if self.config.head == 'electra':  # Built with the rest at init.
      self.replaced_logits(self.encode(targets_BL, targets_positions_BL, targets_segments_BL))
      return self.mlm_logits(self.generate(targets_BL, targets_positions_BL,
                                           targets_segments_BL))
    if self.config.head == 'mlm':
      states_BLE = self.encode(targets_BL, targets_positions_BL, targets_segments_BL)
      if self.config.next_sentence:  # Built with the rest at init.
        self.next_sentence_logits(states_BLE[:, :1])
      return self.mlm_logits(states_BLE)
    return self.head_outputs(inputs_BK)
