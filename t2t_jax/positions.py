"""Position encodings and the embedder that adds them to the token embeddings.

Shapes in names: B batch, L length, E d_model.
"""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def sinusoidal_positions(max_len: int, d_model: int) -> np.ndarray:
  """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(same), as in the paper."""
  position = np.arange(max_len)[:, None]
  div = np.power(10000.0, np.arange(0, d_model, 2) / d_model)[None, :]
  table = np.zeros((max_len, d_model), np.float32)
  table[:, 0::2] = np.sin(position / div)
  table[:, 1::2] = np.cos(position / div)[:, :d_model // 2]
  return table


class Embedder(nn.Module):
  """Token embedding times sqrt(d_model) plus sinusoidal positions, then dropout."""
  config: Any  # model.TransformerConfig
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
