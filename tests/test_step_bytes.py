"""The train step's byte-saving changes (issue 53) against the arithmetic they replace.

In bfloat16 the chunked loss reads bfloat16 logits (the softmax and its sums stay float32) and
attention's softmax backward reads the bfloat16 weights it returned instead of keeping float32
ones. The unchanged step is rebuilt by swapping the two functions back; one update of each is
compared: the loss, the gradients (Adam's first moment after one step is (1 - b1) times the
gradient) and the parameters' updates. In float32 nothing changes, bit for bit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax.model import attention_variants
from t2t_jax.model import transformer
from t2t_jax.training import train

VOCAB = 40
_narrow_output_logits = transformer.output_logits


def _unchanged(monkeypatch):
  """The step as it was: float32 logits into the loss, float32 softmax weights kept."""
  monkeypatch.setattr(attention_variants, 'narrow_softmax',
                      lambda logits, dtype: jax.nn.softmax(logits).astype(dtype))
  monkeypatch.setattr(transformer, 'output_logits',
                      lambda module, y, float32=True: _narrow_output_logits(module, y, True))


def _one_update(config):
  rng = np.random.default_rng(1)
  targets = rng.integers(1, VOCAB, (8, 16))
  targets[::3, 10:] = 0
  batch = {'inputs': rng.integers(1, VOCAB, (8, 16)), 'targets': targets}
  setup = train.build(config, VOCAB)
  state = setup.init(jax.random.PRNGKey(0))
  params = jax.device_get(state.params)  # The step donates the state.
  new_state, metrics = setup.train_step(state, sharding.global_batch(batch, setup.mesh),
                                        jax.random.PRNGKey(3))
  updates = jax.tree.map(lambda new, old: new - old, jax.device_get(new_state.params), params)
  return jax.device_get((metrics, updates, _mu(new_state.opt_state)))


def _mu(opt_state):
  """Adam's first moment wherever optax's chain keeps it."""
  found = [s.mu for s in jax.tree.leaves(opt_state, is_leaf=lambda s: hasattr(s, 'mu'))
           if hasattr(s, 'mu')]
  assert len(found) == 1
  return found[0]


def _relative_error(actual, expected) -> float:
  actual, expected = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
                      for t in (actual, expected))
  return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


@pytest.fixture
def chunked_config(tiny_config):
  tiny_config.opt.loss_chunk_tokens = 48  # 128 tokens: three chunks, the last padded.
  tiny_config.opt.eps = 1.0  # Updates proportional to the gradient: they compare closely.
  return tiny_config


def test_bfloat16_step_agrees_with_the_unchanged_step(chunked_config, monkeypatch):
  """Tolerances: bfloat16 keeps 8 bits of mantissa (relative rounding 2^-9 = 0.2%); the loss
  within 1%, gradients and updates within 3% in relative L2 norm, over a step whose changes
  round the logits and the attention weights once more than before."""
  chunked_config.model.dtype = 'bfloat16'
  changed = _one_update(chunked_config)
  _unchanged(monkeypatch)
  unchanged = _one_update(chunked_config)
  (changed_metrics, changed_updates, changed_mu) = changed
  (metrics, updates, mu) = unchanged
  assert float(changed_metrics['weight']) == float(metrics['weight']) > 0
  np.testing.assert_allclose(changed_metrics['loss'], metrics['loss'], rtol=1e-2)
  np.testing.assert_allclose(changed_metrics['nll'], metrics['nll'], rtol=1e-2)
  assert _relative_error(changed_mu, mu) < 3e-2
  assert _relative_error(changed_updates, updates) < 3e-2
  # And the two are not the same program: the changes do change bfloat16 rounding.
  assert _relative_error(changed_mu, mu) > 0


def test_float32_step_is_unchanged_bit_for_bit(chunked_config, monkeypatch):
  changed = _one_update(chunked_config)
  _unchanged(monkeypatch)
  unchanged = _one_update(chunked_config)
  for actual, expected in zip(jax.tree.leaves(changed), jax.tree.leaves(unchanged)):
    np.testing.assert_array_equal(actual, expected)


def test_narrow_softmax_gradient_is_the_softmax_gradient_of_its_rounded_weights():
  """The backward from the bfloat16 weights y: y (g - sum(y g)), which is the float32 softmax
  gradient up to y's rounding; forward, the float32 softmax rounded once."""
  logits = 3 * jax.random.normal(jax.random.key(0), (2, 3, 5, 7))
  cotangent = jax.random.normal(jax.random.key(1), (2, 3, 5, 7)).astype(jnp.bfloat16)
  weights, vjp = jax.vjp(lambda x: attention_variants.narrow_softmax(x, jnp.bfloat16), logits)
  np.testing.assert_array_equal(weights, jax.nn.softmax(logits).astype(jnp.bfloat16))
  (gradient,) = vjp(cotangent)
  y, g = np.asarray(weights, np.float64), np.asarray(cotangent, np.float64)
  expected = y * (g - (y * g).sum(-1, keepdims=True))
  np.testing.assert_allclose(gradient, expected, atol=1e-6)
  (exact,) = jax.vjp(jax.nn.softmax, logits)[1](cotangent.astype(jnp.float32))
  np.testing.assert_allclose(gradient, exact, atol=2e-2 * float(np.abs(exact).max()))


def test_on_one_cpu_device_the_donated_step_updates_its_weights_in_place(tiny_config,
                                                                        monkeypatch):
  """runtime.train_compiler_options: with XLA's usual copy insertion the CPU step copies each
  donated weight before it overwrites it; with the searches' region analysis, which a CPU
  step takes from 64 MiB of weights (here the threshold is lowered to the tiny model's), it
  copies none, and computes the same update."""
  mesh = sharding.make_mesh(tiny_config.mesh, jax.devices()[:1])  # A CPU user's one device.
  with monkeypatch.context() as patch:
    patch.setattr(runtime, 'CPU_IN_PLACE_WEIGHT_BYTES', 0)
    setup = train.build(tiny_config, VOCAB, mesh)
  rng = np.random.default_rng(0)
  batch = sharding.global_batch({side: rng.integers(1, VOCAB, (8, 16)) for side in
                                 ('inputs', 'targets')}, mesh)
  key = jax.random.PRNGKey(3)
  usual = train.build(tiny_config, VOCAB, mesh)  # Below the threshold: the usual insertion.

  def weight_copies(built):
    text = built.train_step.lower(built.abstract_state, batch, key).compile().as_text()
    return text.count('copy(%state_params')
  assert weight_copies(setup) == 0
  # What the option is for; should XLA's usual copy insertion stop copying, this fails and
  # the option can go.
  assert weight_copies(usual) > 0
  states = [built.train_step(built.init(jax.random.PRNGKey(0)), batch, key)[0]
            for built in (setup, usual)]
  for ours, theirs in zip(*(jax.tree.leaves(jax.device_get(state)) for state in states)):
    np.testing.assert_array_equal(ours, theirs)
