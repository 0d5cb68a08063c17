"""Autoregressive decoding over the key/value cache.

Shapes in names: B batch, K source length, L output length, V vocabulary.
"""

import collections
import dataclasses
import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t2t_jax import EOS_ID, PAD_ID
from t2t_jax.model import Transformer, TransformerConfig


def decode_config(config: TransformerConfig) -> TransformerConfig:
  return dataclasses.replace(config, decode=True, deterministic=True)


def init_cache(config: TransformerConfig, batch_size: int, max_len: int):
  """Zeroed decoder caches for `batch_size` rows and up to `max_len` output tokens."""
  model = Transformer(decode_config(config))
  shapes = jax.eval_shape(
      lambda: model.init(jax.random.PRNGKey(0), jnp.ones((batch_size, 1), jnp.int32),
                         jnp.ones((batch_size, max_len), jnp.int32))['cache'])
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def max_decode_length(source_length: int, extra: int, model_max_len: int) -> int:
  """Source length + `extra`, capped by the position table."""
  return min(source_length + extra, model_max_len)


def greedy_search(params, inputs_BK: jax.Array, config: TransformerConfig,
                  max_len: int) -> jax.Array:
  """Argmax decoding; returns [B, max_len] tokens, EOS included, PAD after it."""
  model = Transformer(decode_config(config))
  batch_size = inputs_BK.shape[0]
  encoded_BKE = model.apply({'params': params}, inputs_BK, method=Transformer.encode)
  cache = init_cache(config, batch_size, max_len)

  def step(carry):
    i, cache, tokens_BL, finished_B = carry
    previous_B1 = jax.lax.dynamic_slice_in_dim(jnp.pad(tokens_BL, ((0, 0), (1, 0))), i, 1, 1)
    logits_B1V, variables = model.apply({'params': params, 'cache': cache}, encoded_BKE,
                                        inputs_BK, previous_B1, mutable=['cache'],
                                        method=Transformer.decode)
    next_B = jnp.where(finished_B, PAD_ID, logits_B1V[:, 0].argmax(-1))
    tokens_BL = jax.lax.dynamic_update_slice_in_dim(tokens_BL, next_B[:, None], i, 1)
    return i + 1, variables['cache'], tokens_BL, finished_B | (next_B == EOS_ID)

  def not_done(carry):
    i, _, _, finished_B = carry
    return (i < max_len) & ~finished_B.all()

  tokens_BL = jnp.zeros((batch_size, max_len), jnp.int32)
  carry = (jnp.array(0), cache, tokens_BL, jnp.zeros((batch_size,), bool))
  return jax.lax.while_loop(not_done, step, carry)[2]


class Translator:
  """Decodes lists of id sequences in length-sorted batches sharded over the mesh's batch axes.

  Batches of one length bucket always have the same shape, so each bucket compiles once.
  """

  def __init__(self, config: TransformerConfig, mesh, axis_rules, batch_tokens: int,
               min_bucket: int, max_extra_len: int):
    self.config, self.mesh, self.axis_rules = config, mesh, axis_rules
    self.batch_tokens, self.min_bucket, self.max_extra_len = batch_tokens, min_bucket, max_extra_len
    self._compiled = {}

  def _search(self, max_len: int):
    if max_len not in self._compiled:
      replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
      self._compiled[max_len] = jax.jit(
          functools.partial(greedy_search, config=self.config, max_len=max_len),
          out_shardings=replicated)
    return self._compiled[max_len]

  def translate(self, params, inputs: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Output ids (EOS included) for each input, in the input order."""
    from t2t_jax import sharding  # Decoding needs only the batch placement helpers.
    shards = sharding.batch_shards(self.mesh)
    outputs = [None] * len(inputs)
    by_length = collections.defaultdict(list)
    for index, seq in enumerate(inputs):
      by_length[-(-max(len(seq), 1) // self.min_bucket) * self.min_bucket].append(index)
    for length, members in sorted(by_length.items()):
      rows = max(shards, self.batch_tokens // length // shards * shards)
      max_len = max_decode_length(length, self.max_extra_len, self.config.max_len)
      for start in range(0, len(members), rows):
        chunk = members[start:start + rows]
        batch = np.full((rows, length), PAD_ID, np.int32)
        for row, index in enumerate(chunk):
          batch[row, :len(inputs[index])] = inputs[index]
        with sharding.mesh_context(self.mesh, self.axis_rules):
          tokens = self._search(max_len)(params, sharding.global_batch(
              {'inputs': batch}, self.mesh, whole=True)['inputs'])
        tokens = np.asarray(jax.device_get(tokens))
        for row, index in enumerate(chunk):
          outputs[index] = tokens[row]
    return outputs
