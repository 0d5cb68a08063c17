"""Position encodings and the embedder that adds them to the token embeddings.

config.model.positions picks one: 'sinusoidal' (the paper), 'predictive' (the lecture's
"predictive information" sinusoids), 'learned' (a trained table), 'relative' (Shaw et al.
2018: nothing is added here; attention.py adds learned embeddings of clipped distances),
'rotary' (RoFormer, Su et al. 2021: queries and keys rotated by position, `rotary`), 'alibi'
(Press et al. 2022: a per-head linear distance bias on the scores, `alibi_bias`) or 'none'.
The last four add nothing to the embeddings. Shapes in names follow the package legend (t2t_jax/__init__.py).
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t2t_jax import ConfigError

Array = jax.Array
POSITION_KINDS = ('sinusoidal', 'predictive', 'learned', 'relative', 'rotary', 'alibi', 'none')
ROTARY_BASE = 10000.0  # RoFormer's base: pair i turns by position x ROTARY_BASE^(-2i/D).
# p of the predictive-information sinusoids, the value the lecture gives. A constant, not a key:
# no one has asked to tune it, and the formula is only defined for p < 1.
PREDICTIVE_P = 0.883


def sinusoidal_positions(max_len: int, d_model: int) -> np.ndarray:
  """PE[pos, 2i] = sin(pos / 10000^(2i/d)), PE[pos, 2i+1] = cos(same), as in the paper."""
  position = np.arange(max_len)[:, None]
  div = np.power(10000.0, np.arange(0, d_model, 2) / d_model)[None, :]
  table = np.zeros((max_len, d_model), np.float32)
  table[:, 0::2] = np.sin(position / div)
  table[:, 1::2] = np.cos(position / div)[:, :d_model // 2]
  return table


def predictive_positions(max_len: int, d_model: int, p: float = PREDICTIVE_P) -> np.ndarray:
  """PE[x, 2i] = sin(x r(i)), PE[x, 2i+1] = cos(x r(i)), r(i) = ((2i+1)/d)^(1/(1-p))."""
  position = np.arange(max_len)[:, None]
  rate = np.power((2 * np.arange(0, (d_model + 1) // 2) + 1) / d_model, 1 / (1 - p))[None, :]
  table = np.zeros((max_len, d_model), np.float32)
  table[:, 0::2] = np.sin(position * rate)
  table[:, 1::2] = np.cos(position * rate)[:, :d_model // 2]
  return table


def rotary(x_BLHD: Array, positions_BL: Array) -> Array:
  """RoFormer's rotary embedding: interleaved pairs (x[2i], x[2i+1]) of each head turned by the
  angle position * 10000^(-2i/D), in float32. `positions_BL` may have a batch axis of 1.

  A rotated query and key have the dot product of the unrotated ones turned by the difference
  of their positions, so scores depend only on the offset between query and key.
  """
  head_dim = x_BLHD.shape[-1]
  frequency_J = ROTARY_BASE ** (-np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
  angle_BL1J = positions_BL.astype(jnp.float32)[..., None, None] * frequency_J
  cos_BL1J, sin_BL1J = jnp.cos(angle_BL1J), jnp.sin(angle_BL1J)
  x_BLHD2 = x_BLHD.astype(jnp.float32).reshape(x_BLHD.shape[:-1] + (head_dim // 2, 2))
  even_BLHJ, odd_BLHJ = x_BLHD2[..., 0], x_BLHD2[..., 1]
  turned_BLHJ2 = jnp.stack([even_BLHJ * cos_BL1J - odd_BLHJ * sin_BL1J,
                            even_BLHJ * sin_BL1J + odd_BLHJ * cos_BL1J], axis=-1)
  return turned_BLHJ2.reshape(x_BLHD.shape).astype(x_BLHD.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
  """ALiBi's head slopes: 2^(-8h/n), h = 1..n, for n a power of two; otherwise those of the
  closest lower power of two p, then every other slope of 2p (Press et al. 2022)."""
  def geometric(count):
    return [2.0 ** (-8.0 * h / count) for h in range(1, count + 1)]
  lower = 2 ** int(math.floor(math.log2(num_heads)))
  slopes = geometric(lower) + geometric(2 * lower)[0::2][:num_heads - lower]
  return np.asarray(slopes, np.float32)


def alibi_bias(query_positions_BQ: Array, key_positions_BK: Array, slopes_H) -> Array:
  """-m_h |i - j|: the float32 bias [B, H, Q, K] ALiBi adds to the scores (causal layers mask
  j > i, so there it is -m_h (i - j)). Batch axes of 1 broadcast."""
  distance_BQK = jnp.abs(query_positions_BQ[..., :, None] - key_positions_BK[..., None, :])
  return -jnp.asarray(slopes_H)[:, None, None] * distance_BQK[..., None, :, :].astype(jnp.float32)


def check_positions(kind: str) -> None:
  if kind not in POSITION_KINDS:
    raise ConfigError(f'config.model.positions={kind!r} must be one of {POSITION_KINDS}')


class Embedder(nn.Module):
  """Token embedding times sqrt(d_model) plus absolute positions (if any), then dropout."""
  config: Any  # model.TransformerConfig
  embedding: nn.Embed
  decode_step: bool = False  # Decoder side: in decode mode, one position per call.

  @nn.compact
  def __call__(self, tokens_BL: Array, positions_BL: Array | None = None) -> Array:
    cfg = self.config
    x_BLE = self.embedding(tokens_BL) * jnp.sqrt(cfg.d_model).astype(cfg.dtype)
    table_LE = self._table()
    length = tokens_BL.shape[1]
    if table_LE is not None and positions_BL is None and not (
        cfg.decode and self.decode_step) and length > cfg.max_len:
      raise ConfigError(f'a batch of {length} positions exceeds config.model.max_len='
                        f'{cfg.max_len}, the longest sequence the position table covers: raise '
                        f'config.model.max_len to at least {length}')
    if table_LE is None:
      pass  # Relative positions live in attention; 'none' has none.
    elif cfg.decode and self.decode_step:
      x_BLE = x_BLE + jax.lax.dynamic_slice_in_dim(table_LE, self._decode_position(), 1)[None]
    elif positions_BL is not None:
      x_BLE = x_BLE + table_LE[positions_BL]
    else:
      x_BLE = x_BLE + table_LE[None, :tokens_BL.shape[1]]
    # A zero added here when 'perturbations' is mutable exposes d(output)/d(embedding).
    x_BLE = self.perturb('embedded', x_BLE)
    x_BLE = nn.Dropout(cfg.dropout)(x_BLE, cfg.deterministic)
    return nn.with_logical_constraint(x_BLE, ('batch', 'length', 'embed'))

  def _table(self) -> Array | None:
    """The [max_len, E] table of absolute positions, or None when none are added."""
    cfg = self.config
    check_positions(cfg.positions)
    if cfg.positions == 'learned':
      # Small, as BERT's and GPT-2's tables start: the scaled token embedding dominates at first.
      init = nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02),
                                          ('length', 'embed'))
      return self.param('position_embedding', init, (cfg.max_len, cfg.d_model),
                        cfg.param_dtype).astype(cfg.dtype)
    tables = {'sinusoidal': sinusoidal_positions, 'predictive': predictive_positions}
    if cfg.positions in tables:
      return jnp.asarray(tables[cfg.positions](cfg.max_len, cfg.d_model), cfg.dtype)
    return None

  def _decode_position(self) -> Array:
    """Index of the step being decoded, counted alongside the attention caches."""
    initialised = self.has_variable('cache', 'position')
    position = self.variable('cache', 'position', lambda: jnp.array(0, jnp.int32))
    current = position.value
    if initialised:
      position.value = current + 1
    return current
