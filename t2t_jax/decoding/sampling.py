"""Sampled decoding over the decoder's key/value cache (temperature, top-k, top-p, a forced
prompt), and the noise of Edunov et al.'s noised beam search, for back-translation.

Shapes in names follow the package legend (t2t_jax/__init__.py); P is a prompt's width.

Every row draws from its own key, fold_in(fold_in(PRNGKey(seed), line), sample), folded with
the token's index at each step: an output depends on the seed, the line's index in the whole
input and the sample's number, never on the batch or bucket it lands in, the process that
translates it, or where an interrupted run resumed. The noise of a noised beam output is drawn
the same way on the host (`noise_words`).
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from t2t_jax import ConfigError
from t2t_jax import PAD_ID
from t2t_jax import runtime
from t2t_jax.decoding import decode
from t2t_jax.model.model_config import TransformerConfig

KINDS = ('none', 'sample', 'noised_beam')  # translate --sampling


@dataclasses.dataclass(frozen=True)
class Sampling:
  """What a sampled search draws from: the softmax of logits / `temperature` (0: the argmax),
  cut to the `top_k` likeliest tokens (0: no cut), then to the smallest set of them whose
  probability reaches `top_p` (1.0: no cut). Ties at either cut are all kept."""
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if not 0 <= self.temperature < math.inf:
      raise ConfigError(f'temperature {self.temperature} must be finite and at least 0 (0: '
                        'greedy)')
    if self.top_k < 0:
      raise ConfigError(f'top_k {self.top_k} must be at least 0 (0: every token)')
    if not 0 < self.top_p <= 1:
      raise ConfigError(f'top_p {self.top_p} must be in (0, 1] (1: every token)')


@dataclasses.dataclass(frozen=True)
class Noise:
  """Edunov et al. (2018)'s noise on a beam output's words: each deleted with probability
  `delete`, each left replaced by `filler` with probability `replace`, then shuffled with no
  word moving more than `swap` positions (Lample et al.'s permutation)."""
  delete: float = 0.1
  replace: float = 0.1
  swap: int = 3
  filler: str = '<blank>'
  seed: int = 0  # With the line and sample, the draw's (`line_rng`).


def kept_logits(logits_BV: jax.Array, sampling: Sampling) -> jax.Array:
  """The logits [B, V] in float32 divided by the temperature, -inf outside the tokens kept
  (PAD never is). Temperature 0 is the caller's: the argmax."""
  logits_BV = logits_BV.astype(jnp.float32) / sampling.temperature
  token_V = jax.lax.broadcasted_iota(jnp.int32, logits_BV.shape, 1)
  logits_BV = jnp.where(token_V == PAD_ID, -jnp.inf, logits_BV)  # At any temperature.
  if sampling.top_k and sampling.top_k < logits_BV.shape[-1]:
    kth_B1 = jax.lax.top_k(logits_BV, sampling.top_k)[0][:, -1:]
    logits_BV = jnp.where(logits_BV >= kth_B1, logits_BV, -jnp.inf)
  if sampling.top_p < 1:
    probs_BV = jax.nn.softmax(logits_BV, axis=-1)
    sorted_BV = -jnp.sort(-probs_BV, axis=-1)
    # A token is kept if the likelier ones before it hold less than top_p: the smallest set
    # that reaches top_p, always at least the likeliest token.
    kept_BV = jnp.cumsum(sorted_BV, axis=-1) - sorted_BV < sampling.top_p
    threshold_B1 = jnp.where(kept_BV, sorted_BV, jnp.inf).min(-1, keepdims=True)
    logits_BV = jnp.where(probs_BV >= threshold_B1, logits_BV, -jnp.inf)
  return logits_BV


def row_keys(seed: int, lines_B: jax.Array, samples_B: jax.Array) -> jax.Array:
  """Each row's key [B, 2]: the seed's folded with its line's index, then its sample's."""
  base = jax.random.PRNGKey(seed)
  return jax.vmap(lambda line, sample: jax.random.fold_in(jax.random.fold_in(base, line),
                                                          sample))(lines_B, samples_B)


def draw(logits_BV: jax.Array, keys_B: jax.Array, index, sampling: Sampling) -> jax.Array:
  """The token [B] each row draws at output position `index`."""
  if sampling.temperature == 0:
    return decode.best_token(logits_BV)
  kept_BV = kept_logits(logits_BV, sampling)
  step_keys_B = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys_B, index)
  return jax.vmap(jax.random.categorical)(step_keys_B, kept_BV).astype(jnp.int32)


def sample_search(params, inputs_BS: jax.Array, lines_B: jax.Array, samples_B: jax.Array,
                  config: TransformerConfig, max_len: int, sampling: Sampling,
                  max_lengths_B: jax.Array | None = None,
                  prompts_BP: jax.Array | None = None) -> jax.Array:
  """Sampled outputs [B, max_len] (EOS included, PAD after), one per row.

  A row's first tokens are its prompt's (`prompts_BP`, PAD-padded: a language model's
  prompt, read one token a step) where given; its output holds them too. Row b generates at
  most `max_lengths_B[b]` tokens, its prompt included.
  """
  runtime.check_search_compiled_here('sample_search')
  keys_B = row_keys(sampling.seed, lines_B, samples_B)
  if prompts_BP is not None:
    prompt_length_B = (prompts_BP != PAD_ID).sum(-1)

  def choose(logits_BV, index):
    token_B = draw(logits_BV, keys_B, index, sampling)
    if prompts_BP is None:
      return token_B
    forced_B = jax.lax.dynamic_index_in_dim(prompts_BP, jnp.minimum(index, prompts_BP.shape[1] - 1),
                                            axis=1, keepdims=False)
    return jnp.where(index < prompt_length_B, forced_B, token_B)

  return decode.token_loop(params, inputs_BS, config, max_len, max_lengths_B, choose)


def line_rng(seed: int, line: int, sample: int) -> np.random.Generator:
  """The host's generator for one output's noise: the same for the same seed, line and sample."""
  return np.random.default_rng([seed, line, sample])


def noise_words(text: str, rng: np.random.Generator, noise: Noise = Noise()) -> str:
  """`text` with `noise`'s deletions, fillers and local shuffle, drawn from `rng`."""
  words = text.split()
  words = [w for w, u in zip(words, rng.random(len(words))) if u >= noise.delete]
  words = [noise.filler if u < noise.replace else w
           for w, u in zip(words, rng.random(len(words)))]
  # Word i sorts by i + U[0, swap + 1): every word before i - swap still sorts before it, every
  # word after i + swap after it, so none moves further than `swap`.
  order = np.argsort(np.arange(len(words)) + rng.uniform(0, noise.swap + 1, len(words)),
                     kind='stable')
  return ' '.join(words[i] for i in order)
