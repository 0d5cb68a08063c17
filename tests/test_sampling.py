"""Sampled decoding: its draws against the model's softmax (chi-square), the top-k and top-p
cuts against a plain numpy reference, temperature towards 0 against greedy search, forced
prompts against teacher forcing, reproducibility whatever the batching, and the noised beam's
noise against its rates."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from t2t_jax import ConfigError
from t2t_jax import EOS_ID, PAD_ID
from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax.decoding import sampling
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.model import decoder_only
from t2t_jax.model import transformer as model_lib
from test_decode import CONFIG, _random_params, _sources, greedy_search

LM_CONFIG = dataclasses.replace(CONFIG, vocab_size=13, kind='decoder_only')

sample_search = runtime.jit_search(sampling.sample_search,
                                   static_argnames=('config', 'max_len', 'sampling'))


def _sample(params, inputs, policy, max_len=8, lines=None, samples=None, config=CONFIG, **kw):
  rows = inputs.shape[0]
  lines = jnp.arange(rows) if lines is None else jnp.asarray(lines)
  samples = jnp.zeros(rows, jnp.int32) if samples is None else jnp.asarray(samples)
  return np.asarray(sample_search(params, inputs, lines, samples, config=config,
                                  max_len=max_len, sampling=policy, **kw))


def _teacher_forced_probs(params, source, prefix, temperature=1.0):
  """p(token | source, prefix) over the vocabulary, by one uncached pass of the model."""
  logits = model_lib.Transformer(CONFIG).apply(
      {'params': params}, jnp.asarray(source)[None],
      jnp.asarray(list(prefix) + [2], jnp.int32)[None])[0, len(prefix)]
  logits = np.asarray(logits, np.float64) / temperature
  logits[PAD_ID] = -np.inf
  probs = np.exp(logits - logits.max())
  return probs / probs.sum()


def _chi_square_p(counts, probs) -> float:
  """Pearson's test of counts against probs, the cells expecting fewer than 5 draws pooled."""
  probs = np.asarray(probs) / np.sum(probs)
  counts, expected = np.asarray(counts, float), probs * np.sum(counts)
  big = expected >= 5
  observed = np.append(counts[big], counts[~big].sum())
  expected = np.append(expected[big], expected[~big].sum())
  if expected[-1] < 5:  # The pool too small to be a cell: joined to the smallest big one.
    observed, expected = observed[:-1], expected[:-1]
    smallest = np.argmin(expected)
    observed[smallest] += counts[~big].sum()
    expected[smallest] += probs[~big].sum() * np.sum(counts)
  return stats.chisquare(observed, expected).pvalue


DRAWS = 6000


@pytest.mark.parametrize('policy', [sampling.Sampling(temperature=1.0, seed=3),
                                    sampling.Sampling(temperature=0.7, seed=4),
                                    sampling.Sampling(temperature=1.3, top_k=4, seed=5)])
def test_sampled_token_frequencies_match_the_models_softmax(policy):
  params = _random_params(std=0.5)  # Spread-out softmaxes: the likeliest token about 0.35.
  source = _sources()[0]
  inputs = jnp.broadcast_to(source, (DRAWS, source.shape[0]))
  tokens = _sample(params, inputs, policy, max_len=2)
  probs = _teacher_forced_probs(params, source, [], policy.temperature)
  if policy.top_k:
    kept = probs >= np.sort(probs)[-policy.top_k]
    probs = np.where(kept, probs, 0) / probs[kept].sum()
    assert set(np.unique(tokens[:, 0])) <= set(np.flatnonzero(kept))
  first = np.bincount(tokens[:, 0], minlength=CONFIG.vocab_size)
  p_first = _chi_square_p(first[probs > 0], probs[probs > 0])
  print(f'\n{policy}: first token p={p_first:.3f}', end='')  # Seen with pytest -s.
  assert p_first > 1e-3
  # The test can fail: the same draws are far from the untempered softmax.
  if policy.temperature != 1.0:
    untempered = _teacher_forced_probs(params, source, [])
    p_untempered = _chi_square_p(first, untempered)
    print(f'; against the untempered softmax p={p_untempered:.1e}', end='')
    assert p_untempered < 1e-6
  # The second token, drawn through the cache, given the commonest first one.
  token = int(np.argmax(first))
  given = tokens[tokens[:, 0] == token]
  if token != EOS_ID and not policy.top_k:
    second = np.bincount(given[:, 1], minlength=CONFIG.vocab_size)
    conditional = _teacher_forced_probs(params, source, [token], policy.temperature)
    p_second = _chi_square_p(second, conditional)
    print(f'; second token p={p_second:.3f} ({len(given)} draws)', end='')
    assert p_second > 1e-3


def _reference_kept(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
  """Which tokens a row keeps, by plain loops over its tokens in order of probability."""
  kept = np.zeros(logits.shape, bool)
  for row, values in enumerate(logits):
    values = values.astype(np.float64).copy()
    values[PAD_ID] = -np.inf
    order = sorted(range(len(values)), key=lambda t: -values[t])
    if top_k:
      kth = values[order[top_k - 1]]
      values = np.where(values >= kth, values, -np.inf)
    probs = np.exp(values - values.max())
    probs /= probs.sum()
    total, chosen = 0.0, []
    for t in order:
      if total >= top_p or probs[t] == 0:
        break
      chosen.append(t)
      total += probs[t]
    smallest = min(probs[t] for t in chosen)
    kept[row] = probs >= smallest * (1 - 1e-6)  # Ties with the last one chosen stay.
  return kept


@pytest.mark.parametrize('top_k, top_p', [(3, 1.0), (0, 0.5), (0, 0.9), (5, 0.7), (1, 1.0),
                                          (0, 0.05)])
def test_top_k_and_top_p_keep_what_a_plain_reference_keeps(top_k, top_p):
  rng = np.random.default_rng(top_k * 10 + int(top_p * 100))
  logits = rng.normal(0, 2, (64, 40)).astype(np.float32)
  logits[0, 5:9] = 3.0  # Ties at the cut.
  logits[1] = 0.0  # All tied.
  got = np.isfinite(np.asarray(jax.jit(sampling.kept_logits, static_argnums=1)(
      jnp.asarray(logits), sampling.Sampling(top_k=top_k, top_p=top_p))))
  np.testing.assert_array_equal(got, _reference_kept(logits, top_k, top_p))
  assert not got[:, PAD_ID].any() and got.any(-1).all()


def test_temperature_towards_zero_is_greedy_search():
  params = _random_params(seed=2)
  inputs = _sources(seed=4)
  greedy = np.asarray(greedy_search(params, inputs, config=CONFIG, max_len=8))
  for temperature in (0.0, 1e-4):
    np.testing.assert_array_equal(
        _sample(params, inputs, sampling.Sampling(temperature=temperature)), greedy)
  assert (_sample(params, inputs, sampling.Sampling(temperature=1.0)) != greedy).any()


def test_a_rows_output_depends_on_seed_line_and_sample_only():
  params = _random_params()
  inputs = _sources(rows=8)
  policy = sampling.Sampling(seed=11)
  lines = np.arange(100, 108)
  together = _sample(params, inputs, policy, lines=lines)
  np.testing.assert_array_equal(_sample(params, inputs, policy, lines=lines), together)
  # Reordered, or alone in a batch of one: the same output for the same line.
  order = np.random.default_rng(0).permutation(8)
  np.testing.assert_array_equal(_sample(params, inputs[order], policy, lines=lines[order]),
                                together[order])
  np.testing.assert_array_equal(_sample(params, inputs[3:4], policy, lines=lines[3:4]),
                                together[3:4])
  # Another seed, another line or another sample number draws again.
  draws = [_sample(params, inputs, sampling.Sampling(seed=12), lines=lines),
           _sample(params, inputs, policy, lines=lines + 8),
           _sample(params, inputs, policy, lines=lines, samples=np.ones(8, np.int32))]
  for other in draws:
    assert (other != together).any()


def test_a_language_models_prompt_is_forced_then_continued():
  params = _random_params(LM_CONFIG, seed=3)
  prompts = jnp.array([[5, 6, 7, 8], [9, 0, 0, 0], [0, 0, 0, 0]], jnp.int32)
  empty_source = jnp.zeros((3, 1), jnp.int32)
  tokens = _sample(params, empty_source, sampling.Sampling(temperature=0), max_len=10,
                   config=LM_CONFIG, prompts_BP=prompts)
  # Independently: one uncached pass over [prompt, output so far] per position.
  model = decoder_only.make_model(LM_CONFIG)
  for row, length in enumerate([4, 1, 0]):
    np.testing.assert_array_equal(tokens[row, :length], prompts[row, :length])
    end = (list(tokens[row]).index(EOS_ID) + 1) if EOS_ID in tokens[row] else 10
    logits = np.array(model.apply({'params': params}, empty_source[row:row + 1],
                                    jnp.asarray(tokens[row:row + 1])))[0]
    logits[:, PAD_ID] = -np.inf
    np.testing.assert_array_equal(tokens[row, length:end], logits.argmax(-1)[length:end])
  # Sampled, the prompt is still kept.
  drawn = _sample(params, empty_source, sampling.Sampling(seed=1), max_len=10,
                  config=LM_CONFIG, prompts_BP=prompts)
  np.testing.assert_array_equal(drawn[0, :4], prompts[0])


def _translator(config=CONFIG, batch_tokens=64, policy=None):
  mesh_config = _mesh_config()
  return translator_lib.Translator(config, sharding.make_mesh(mesh_config),
                                   sharding.rules(mesh_config), batch_tokens=batch_tokens,
                                   min_bucket=4, max_extra_len=6, sampling=policy)


def _mesh_config():
  from configs import base  # pylint: disable=import-outside-toplevel
  return base.get_config().mesh


def test_the_translator_samples_each_line_alike_in_any_batching_and_chunk():
  params = _random_params()
  rng = np.random.default_rng(5)
  inputs = [np.append(rng.integers(2, 9, n), EOS_ID).astype(np.int32)
            for n in rng.integers(1, 12, 20)]
  policy = sampling.Sampling(top_p=0.9, seed=7)
  whole = _translator(policy=policy).translate(params, inputs, samples=3)
  assert len(whole) == 60
  small = _translator(batch_tokens=16, policy=policy)
  chunks = (small.translate(params, inputs[:7], samples=3) +
            small.translate(params, inputs[7:], samples=3, first_line=7))
  for a, b in zip(whole, chunks):
    np.testing.assert_array_equal(a, b)
  # The three samples of a line differ somewhere over the file.
  assert any((len(whole[3 * n]) != len(whole[3 * n + 1])) or
             (whole[3 * n] != whole[3 * n + 1]).any() for n in range(20))
  with pytest.raises(ValueError, match='samples per input need sampling'):
    _translator().translate(params, inputs, samples=2)


def test_sampling_options_are_checked():
  for temperature in (-1, float('inf'), float('nan')):
    with pytest.raises(ConfigError, match='temperature'):
      sampling.Sampling(temperature=temperature)
  # PAD stays out at a temperature that flattens every other logit.
  hot = sampling.kept_logits(jnp.zeros((1, 5)).at[0, PAD_ID].set(50.0),
                             sampling.Sampling(temperature=1e30))
  assert np.asarray(hot)[0, PAD_ID] == -np.inf and np.isfinite(np.asarray(hot)[0, 1:]).all()
  with pytest.raises(ConfigError, match='top_k'):
    sampling.Sampling(top_k=-2)
  with pytest.raises(ConfigError, match='top_p'):
    sampling.Sampling(top_p=0)


def test_noised_beam_noise_has_its_rates_and_moves_no_word_further_than_three():
  noise = sampling.Noise()
  text = ' '.join(f'w{i}' for i in range(40))
  deleted = replaced = kept = 0
  for line in range(500):
    out = sampling.noise_words(text, sampling.line_rng(0, line, 0), noise).split()
    deleted += 40 - len(out)
    replaced += out.count(noise.filler)
    kept += len(out)
    real = [w for w in out if w != noise.filler]
    assert len(set(real)) == len(real)  # Nothing duplicated.
  words_seen = 500 * 40
  print(f'\ndeleted {deleted / words_seen:.4f} of {words_seen} words, replaced '
        f'{replaced / kept:.4f} of {kept}')
  # Binomial rates within 4 standard deviations.
  assert abs(deleted / words_seen - 0.1) < 4 * np.sqrt(0.09 / words_seen)
  assert abs(replaced / kept - 0.1) < 4 * np.sqrt(0.09 / kept)
  # The shuffle alone: word i lands within 3 positions of i, and every offset in [-3, 3] occurs.
  shuffle = sampling.Noise(delete=0.0, replace=0.0)
  offsets = np.concatenate([
      [position - int(word[1:]) for position, word in
       enumerate(sampling.noise_words(text, sampling.line_rng(1, line, 0), shuffle).split())]
      for line in range(200)])
  assert np.abs(offsets).max() <= 3
  assert set(offsets) == set(range(-3, 4))
  assert 0.3 < np.mean(offsets == 0) < 0.9  # Shuffled, but most words move little.
  # Reproducible from (seed, line, sample); another sample draws other noise.
  once = sampling.noise_words(text, sampling.line_rng(4, 9, 0))
  assert once == sampling.noise_words(text, sampling.line_rng(4, 9, 0))
  assert once != sampling.noise_words(text, sampling.line_rng(4, 9, 1))


def test_the_sampled_search_compiles_for_a_tpu_slice_without_one(libtpu, no_persistent_cache):
  """The sampled search, nucleus cut included (a sort per step), sharded over a TPU target's
  batch axis and compiled by libtpu on this CPU; no concrete array is made for it."""
  from t2t_jax.compile import targets  # pylint: disable=import-outside-toplevel
  target = targets.parse('tpu:v5e-8')
  mesh = jax.sharding.Mesh(np.array(targets.devices(target)), ('data',))
  rows = 2 * len(mesh.devices)
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params = jax.eval_shape(lambda: _random_params(LM_CONFIG))
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                        params)
  shapes = {name: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch) for name, shape in (
      ('inputs', (rows, 1)), ('lines', (rows,)), ('samples', (rows,)), ('prompts', (rows, 6)),
      ('limits', (rows,)))}
  search = runtime.jit_search(sampling.sample_search, 'tpu',
                              static_argnames=('config', 'max_len', 'sampling'),
                              out_shardings=replicated)
  compiled = search.lower(params, shapes['inputs'], shapes['lines'], shapes['samples'],
                          config=LM_CONFIG, max_len=12,
                          sampling=sampling.Sampling(temperature=0.8, top_k=5, top_p=0.9),
                          max_lengths_B=shapes['limits'], prompts_BP=shapes['prompts']).compile()
  assert 'while' in compiled.as_text()  # One loop over the output positions.
