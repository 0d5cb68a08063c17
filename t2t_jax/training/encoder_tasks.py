"""The encoder-only model's objectives (training/task.py): masked-LM or ELECTRA pre-training
and classification or regression fine-tuning.

Masked LM (BERT): in each row a fraction config.data.mlm_rate (15%) of its maskable tokens
(not padding, [CLS], [SEP] or EOS) is chosen, exactly round(rate x maskable) of them (at least
one); each chosen token is replaced by [MASK] with probability 0.8, by a random ordinary token
with 0.1, and kept with 0.1. Only the chosen positions go through the output layer: the
objective gathers their final states, K = ceil(rate x L) per row (a few more with whole-word
masking, whose last word may overrun the count). The choice is drawn from the step's key, the
one its dropout folds from the step number, so a resumed run draws exactly the masks an
uninterrupted one would; evaluation draws one fixed set, the same at every evaluation.

ELECTRA (Clark et al. 2020) chooses positions the same way, replaces every chosen token by
[MASK] for its generator, whose masked-LM loss is the same as above, and gives the encoder (the
discriminator) the text with each chosen token replaced by one drawn from the generator's
softmax (ordinary tokens only, no gradient through the draw); the encoder says of every real
token whether it differs from the original (a draw of the original token is not a
replacement).

Whole-word masking (config.data.whole_word_masking) chooses words: a word is a piece starting
with SentencePiece's word marker and the pieces after it; the pipeline gives each token's
word-start flag in the batch's 'inputs' (data/pipeline.py), laid out like the text in
'targets'.
"""

import math

import jax
import jax.numpy as jnp
import optax

from t2t_jax import EOS_ID, PAD_ID
from t2t_jax.training import optim

CLS_ID, SEP_ID, MASK_ID = 3, 4, 5  # data/tokenizer.py's reserved pieces.
FIRST_ORDINARY_ID = 6  # Random replacements are drawn from [6, vocab size).
WORD_START = 2  # The pipeline's word-start flag (1: a word's later piece; 0: padding).
IS_NEXT, NOT_NEXT = 3, 4  # Its flag at a next-sentence pair's [CLS] (also a word start).
_MASK_STREAM = 0x6D6C6D  # Folded into the step's key: the masks' own stream.


def mlm_slots(length: int, rate: float, whole_word: bool) -> int:
  """K: the chosen positions gathered per row of `length` tokens."""
  slots = math.ceil(rate * length)
  if whole_word:  # Room for the last chosen word's later pieces.
    slots += math.ceil(0.05 * length) + 1
  return max(1, min(length, slots))


def choose(key: jax.Array, tokens_BL: jax.Array, word_start_BL: jax.Array, rate: float,
           whole_word: bool) -> tuple[jax.Array, jax.Array]:
  """(positions [B, K], chosen [B, K]): the chosen tokens of each row, in order of choice,
  and which of the K slots hold one (the rest point at unchosen tokens and score nothing)."""
  length = tokens_BL.shape[1]
  maskable_BL = ((tokens_BL != PAD_ID) & (tokens_BL != EOS_ID) & (tokens_BL != CLS_ID)
                 & (tokens_BL != SEP_ID))
  maskable_B = maskable_BL.sum(1)
  count_B1 = jnp.where(maskable_B > 0, jnp.maximum(1, jnp.round(rate * maskable_B)), 0)[:, None]
  priority_BL = jax.random.uniform(key, tokens_BL.shape)
  index_L = jnp.arange(length)
  if whole_word:  # Every piece of a word takes its first piece's priority.
    start_BL = jax.lax.cummax(jnp.where(word_start_BL, index_L, 0), axis=1)
    priority_BL = jnp.take_along_axis(priority_BL, start_BL, axis=1)
  priority_BL = jnp.where(maskable_BL, priority_BL, 2.0)
  order_BL = jnp.argsort(priority_BL, axis=1, stable=True)  # Ties: a word's pieces in order.
  rank_BL = jnp.argsort(order_BL, axis=1)
  if whole_word:  # A word is in when its first maskable piece is within the count.
    first_rank_BL = jnp.take_along_axis(rank_BL, start_BL, axis=1)
    in_word_BL = jnp.where(maskable_BL & jnp.take_along_axis(maskable_BL, start_BL, axis=1),
                           first_rank_BL, rank_BL)
    chosen_BL = maskable_BL & (in_word_BL < count_B1)
  else:
    chosen_BL = maskable_BL & (rank_BL < count_B1)
  slots = mlm_slots(length, rate, whole_word)
  key_BL = jnp.where(chosen_BL, rank_BL, length + index_L)
  positions_BK = jnp.argsort(key_BL, axis=1)[:, :slots]
  return positions_BK, jnp.take_along_axis(chosen_BL, positions_BK, axis=1)


def corrupt(key: jax.Array, tokens_BL: jax.Array, positions_BK: jax.Array,
            chosen_BK: jax.Array, vocab_size: int) -> jax.Array:
  """The model's input: chosen tokens 80% [MASK], 10% a random ordinary token, 10% kept."""
  choice_key, token_key = jax.random.split(key)
  draw_BK = jax.random.uniform(choice_key, positions_BK.shape)
  random_BK = jax.random.randint(token_key, positions_BK.shape, FIRST_ORDINARY_ID, vocab_size)
  new_BK = jnp.where(draw_BK < 0.8, MASK_ID, random_BK)
  return replace_chosen(tokens_BL, positions_BK, chosen_BK & (draw_BK < 0.9), new_BK)


def replace_chosen(tokens_BL: jax.Array, positions_BK: jax.Array, chosen_BK: jax.Array,
                   new_BK: jax.Array) -> jax.Array:
  """`tokens_BL` with the chosen slots' tokens set to `new_BK`; the other slots (distinct
  positions, argsort's) are pointed past the row and dropped, so they stay as they were."""
  at_BK = jnp.where(chosen_BK, positions_BK, tokens_BL.shape[1])
  return jax.vmap(lambda row, at, values: row.at[at].set(values, mode='drop'))(
      tokens_BL, at_BK, new_BK)


def mask_key(rngs: dict | None) -> jax.Array:
  """The masks' key: the step's dropout key folded with the masks' stream, or in evaluation
  (no key) one fixed key."""
  if not rngs or 'dropout' not in rngs:
    return jax.random.key(0)
  return jax.random.fold_in(rngs['dropout'], _MASK_STREAM)


def mlm_metrics(model, params, batch: dict, label_smoothing: float, loss_chunk_tokens: int = 0,
                *, rate: float = 0.15, whole_word: bool = False, **kwargs) -> dict[str, jax.Array]:
  """Metric sums of the masked-LM loss on the chosen positions (`optim.compute_metrics`:
  'loss', 'nll', 'correct', 'weight' = chosen tokens).

  With next-sentence prediction (config.model.next_sentence) 'loss' also holds that loss, as
  BERT sums the two means: each pair's cross-entropy weighted by chosen tokens / pairs of the
  (micro-)batch, so the loop's division by 'weight' gives MLM mean + NSP mean. 'nll',
  'correct' and 'weight' stay the masked tokens'; 'next_sentence_loss', '_correct' and
  '_weight' are the pairs' sums.
  """
  del loss_chunk_tokens  # Only K of L positions reach the output layer: no chunking needed.
  tokens_BL = batch['targets']
  choose_key, corrupt_key = jax.random.split(mask_key(kwargs.get('rngs')))
  flags_BL = batch['inputs']
  positions_BK, chosen_BK = choose(choose_key, tokens_BL, flags_BL >= WORD_START, rate,
                                   whole_word)
  corrupted_BL = corrupt(corrupt_key, tokens_BL, positions_BK, chosen_BK,
                         model.config.vocab_size)
  states_BLE = model.apply({'params': params}, corrupted_BL, batch.get('targets_positions'),
                           batch.get('targets_segments'), method='encode', **kwargs)
  picked_BKE = jnp.take_along_axis(states_BLE, positions_BK[..., None], axis=1)
  with jax.named_scope('loss'):
    logits_BKV = model.apply({'params': params}, picked_BKE, method='mlm_logits')
    labels_BK = jnp.where(chosen_BK, jnp.take_along_axis(tokens_BL, positions_BK, axis=1),
                          PAD_ID)
    metrics = optim.compute_metrics(logits_BKV, labels_BK, label_smoothing)
    if model.config.next_sentence:
      metrics.update(_next_sentence_sums(model, params, states_BLE, flags_BL))
      pairs = jnp.maximum(metrics['next_sentence_weight'], 1.0)
      metrics['loss'] = (metrics['loss'] + metrics['next_sentence_loss']
                         * jax.lax.stop_gradient(metrics['weight'] / pairs))
    return metrics


def electra_metrics(model, params, batch: dict, label_smoothing: float,
                    loss_chunk_tokens: int = 0, *, rate: float = 0.15, whole_word: bool = False,
                    replaced_weight: float = 50.0, **kwargs) -> dict[str, jax.Array]:
  """Metric sums of ELECTRA's two losses: 'loss', 'nll', 'correct' and 'weight' are the
  generator's masked-LM figures as in `mlm_metrics`, and 'replaced_loss', '_correct' and
  '_weight' the discriminator's sums over the real tokens (sigmoid cross-entropy, logit > 0
  read as 'replaced'). 'loss' also holds the discriminator's, weighted as the paper's
  generator mean + replaced_weight x discriminator mean once the loop divides by 'weight'."""
  del loss_chunk_tokens
  tokens_BL = batch['targets']
  choose_key, sample_key = jax.random.split(mask_key(kwargs.get('rngs')))
  positions_BK, chosen_BK = choose(choose_key, tokens_BL, batch['inputs'] >= WORD_START, rate,
                                   whole_word)
  masked_BL = replace_chosen(tokens_BL, positions_BK, chosen_BK,
                             jnp.full_like(positions_BK, MASK_ID))
  where = (batch.get('targets_positions'), batch.get('targets_segments'))
  generated_BLE = model.apply({'params': params}, masked_BL, *where, method='generate',
                              **kwargs)
  picked_BKE = jnp.take_along_axis(generated_BLE, positions_BK[..., None], axis=1)
  original_BK = jnp.take_along_axis(tokens_BL, positions_BK, axis=1)
  with jax.named_scope('loss'):
    logits_BKV = model.apply({'params': params}, picked_BKE, method='mlm_logits')
    metrics = optim.compute_metrics(logits_BKV, jnp.where(chosen_BK, original_BK, PAD_ID),
                                    label_smoothing)
  ordinary_V = jnp.arange(logits_BKV.shape[-1]) >= FIRST_ORDINARY_ID
  proposal_BKV = jnp.where(ordinary_V, jax.lax.stop_gradient(logits_BKV), -jnp.inf)
  sampled_BK = jax.random.categorical(sample_key, proposal_BKV)
  replaced_input_BL = replace_chosen(tokens_BL, positions_BK, chosen_BK, sampled_BK)
  states_BLE = model.apply({'params': params}, replaced_input_BL, *where, method='encode',
                           **kwargs)
  with jax.named_scope('loss'):
    logits_BL = model.apply({'params': params}, states_BLE, method='replaced_logits')
    replaced_BL = (replaced_input_BL != tokens_BL).astype(jnp.float32)
    real_BL = (tokens_BL != PAD_ID).astype(jnp.float32)
    loss_BL = optax.sigmoid_binary_cross_entropy(logits_BL, replaced_BL)
    metrics['replaced_loss'] = (loss_BL * real_BL).sum()
    metrics['replaced_correct'] = (((logits_BL > 0) == (replaced_BL > 0)) * real_BL).sum()
    metrics['replaced_weight'] = real_BL.sum()
    tokens = jnp.maximum(metrics['replaced_weight'], 1.0)
    metrics['loss'] = (metrics['loss'] + replaced_weight * metrics['replaced_loss']
                       * jax.lax.stop_gradient(metrics['weight'] / tokens))
  return metrics


def _next_sentence_sums(model, params, states_BLE: jax.Array, flags_BL: jax.Array) -> dict:
  """Cross-entropy, correct answers and count of the pairs: at each [CLS] (flag IS_NEXT or
  NOT_NEXT, data/pipeline.py), is its second sentence the line after its first?"""
  logits_BL2 = model.apply({'params': params}, states_BLE, method='next_sentence_logits')
  pair_BL = (flags_BL == IS_NEXT) | (flags_BL == NOT_NEXT)
  label_BL = (flags_BL == NOT_NEXT).astype(jnp.int32)
  nll_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BL2, label_BL)
  weight_BL = pair_BL.astype(jnp.float32)
  return {'next_sentence_loss': (nll_BL * weight_BL).sum(),
          'next_sentence_correct': ((logits_BL2.argmax(-1) == label_BL) * weight_BL).sum(),
          'next_sentence_weight': weight_BL.sum()}


def regression_values(targets_B2: jax.Array) -> jax.Array:
  """The float32 values a regression row carries as bits in its second target id."""
  return jax.lax.bitcast_convert_type(targets_B2[:, 1], jnp.float32)


def head_metrics(model, params, batch: dict, label_smoothing: float, loss_chunk_tokens: int = 0,
                 **kwargs) -> dict[str, jax.Array]:
  """Metric sums of a classifier (cross-entropy with label smoothing; 'correct' by argmax) or
  a regressor (squared error as 'loss' and 'nll'; 'correct' is 0) on one row per example.

  A row's first target id is its label's index + 1 (0: a padding row, of weight 0); a
  regression row's second id holds its value (data/classification.py)."""
  del loss_chunk_tokens
  outputs_BC = model.apply({'params': params}, batch['inputs'], method='head_outputs', **kwargs)
  first_B = batch['targets'][:, 0]
  real_B = (first_B != PAD_ID).astype(jnp.float32)
  with jax.named_scope('loss'):
    if model.config.head == 'regression':
      error_B = jnp.square(outputs_BC[:, 0] - regression_values(batch['targets'])) * real_B
      return {'loss': error_B.sum(), 'nll': error_B.sum(), 'correct': jnp.zeros(()),
              'weight': real_B.sum()}
    labels_B = jnp.maximum(first_B - 1, 0)
    classes = outputs_BC.shape[-1]
    one_hot_BC = jax.nn.one_hot(labels_B, classes)
    loss_B = optax.softmax_cross_entropy(outputs_BC, optax.smooth_labels(one_hot_BC,
                                                                         label_smoothing))
    nll_B = optax.softmax_cross_entropy(outputs_BC, one_hot_BC)
    correct_B = (outputs_BC.argmax(-1) == labels_B).astype(jnp.float32)
    return {'loss': (loss_B * real_B).sum(), 'nll': (nll_B * real_B).sum(),
            'correct': (correct_B * real_B).sum(), 'weight': real_B.sum()}
