"""ReLU then dropout, as the feed-forward networks apply them, with a backward pass that needs
only the output.

`nn.Dropout(rate)(nn.relu(h))` keeps two things for its gradient: the boolean mask and the
pre-activation `h` (for ReLU's derivative). Both are told by the output: an element passes
its gradient exactly where the output is positive (kept by the mask and positive before
the ReLU), and the output is kept anyway as the next matmul's input. So the forward pass
writes no mask and the backward pass reads the output instead of the mask and `h`: a byte per
hidden activation less written and read by a memory-bound accelerator step.

The same mask is drawn as `nn.Dropout` draws it (its module name keeps the dropout key's
path), so outputs and gradients equal the unfused pair's bit for bit, save where a positive
`h / (1 - rate)` underflows to zero (a subnormal flushed), whose gradient becomes 0.
"""

import functools

import flax.linen as nn
import jax
from jax import lax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _relu_dropout(x, keep_mask, keep_prob: float):
  return lax.select(keep_mask, nn.relu(x) / keep_prob, jnp.zeros_like(x))


def _forward(x, keep_mask, keep_prob):
  y = _relu_dropout(x, keep_mask, keep_prob)
  return y, y


def _backward(keep_prob, y, dy):
  return lax.select(y > 0, dy / keep_prob, jnp.zeros_like(dy)), None


_relu_dropout.defvjp(_forward, _backward)


class ReluDropout(nn.Dropout):
  """`nn.Dropout(rate)(nn.relu(x))`, the mask and `x` not kept for the backward pass. Name it
  as the `nn.Dropout` it replaces (e.g. 'Dropout_0') to draw that module's masks."""

  @nn.compact
  def __call__(self, inputs, deterministic: bool | None = None, rng=None):
    deterministic = nn.merge_param('deterministic', self.deterministic, deterministic)
    if self.rate == 0.0 or deterministic:
      return nn.relu(inputs)
    if self.rate == 1.0:
      return jnp.zeros_like(inputs)
    if self.broadcast_dims:
      raise NotImplementedError('ReluDropout draws one mask element per activation')
    keep_prob = 1.0 - self.rate
    if rng is None:
      rng = self.make_rng(self.rng_collection)
    keep_mask = jax.random.bernoulli(rng, p=keep_prob, shape=inputs.shape)
    return _relu_dropout(inputs, keep_mask, keep_prob)
