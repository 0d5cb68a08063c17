"""Label-smoothed loss (whole or in chunks of tokens), learning-rate schedules, optax chain, and
the moving average of the weights."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from t2t_jax import ConfigError
from t2t_jax import PAD_ID


def smoothed_target(vocab_size: int, label_smoothing: float) -> tuple[float, float, float]:
  """The target's probability, every other entry's, and the distribution's entropy."""
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab_size - 1)
  entropy = -(confidence * np.log(confidence) + (vocab_size - 1) * low * np.log(low + 1e-20))
  return confidence, low, entropy


def smoothed_cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array,
                           label_smoothing: float) -> tuple[jax.Array, jax.Array]:
  """Per-token label-smoothed cross-entropy and the non-pad weights.

  The target gets `1 - label_smoothing`, every other entry `label_smoothing / (V - 1)`.
  The entropy of that distribution is subtracted, so a prediction equal to it scores 0.
  Written without a one-hot [B, L, V] tensor: sum_v q_v log p_v = low * sum_v log p_v +
  (confidence - low) * log p_target.
  """
  vocab_size = logits_BLV.shape[-1]
  confidence, low, entropy = smoothed_target(vocab_size, label_smoothing)
  log_probs_BLV = jax.nn.log_softmax(logits_BLV.astype(jnp.float32))
  target_log_prob_BL = jnp.take_along_axis(log_probs_BLV, targets_BL[..., None], -1)[..., 0]
  cross_entropy_BL = -(low * log_probs_BLV.sum(-1) + (confidence - low) * target_log_prob_BL)
  weights_BL = (targets_BL != PAD_ID).astype(jnp.float32)
  return (cross_entropy_BL - entropy) * weights_BL, weights_BL


def compute_metrics(logits_BLV: jax.Array, targets_BL: jax.Array,
                    label_smoothing: float) -> dict[str, jax.Array]:
  """Sums over the batch; divide by `weight` for means (exact across devices and batches)."""
  loss_BL, weights_BL = smoothed_cross_entropy(logits_BLV, targets_BL, label_smoothing)
  nll_BL, _ = smoothed_cross_entropy(logits_BLV, targets_BL, 0.0)
  correct_BL = (logits_BLV.argmax(-1) == targets_BL) * weights_BL
  return {'loss': loss_BL.sum(), 'nll': nll_BL.sum(), 'correct': correct_BL.sum(),
          'weight': weights_BL.sum()}


def metrics_and_logits_grad(logits_TV: jax.Array, targets_T: jax.Array,
                            label_smoothing: float) -> tuple[dict[str, jax.Array], jax.Array]:
  """`compute_metrics` of a chunk and d loss / d logits, written out in a few fused passes.

  With p = softmax(logits) and the smoothed target q, d loss / d logits = w * (p - q): one
  elementwise pass that builds q from an iota comparison rather than autodiff's scatter into
  a zero [N, V] tensor. A token counts as correct when its target's logit is the maximum
  (argmax, up to exact ties), which reuses the softmax's maximum instead of another reduction.
  """
  vocab_size = logits_TV.shape[-1]
  confidence, low, entropy = smoothed_target(vocab_size, label_smoothing)
  # Every [T, V] pass reads the logits as they came (bfloat16: half the bytes) and widens
  # them itself; the target's logit is gathered from them too, so no float32 [T, V] array
  # is needed by two passes and written out between them.
  max_T = logits_TV.max(-1).astype(jnp.float32)
  shifted_TV = logits_TV.astype(jnp.float32) - max_T[:, None]
  exp_TV = jnp.exp(shifted_TV)
  sum_exp_T = exp_TV.sum(-1)
  log_sum_T = jnp.log(sum_exp_T)
  target_T = (jnp.take_along_axis(logits_TV, targets_T[:, None], -1)[:, 0].astype(jnp.float32)
              - max_T)
  weights_T = (targets_T != PAD_ID).astype(jnp.float32)
  nll_T = log_sum_T - target_T
  sum_log_probs_T = shifted_TV.sum(-1) - vocab_size * log_sum_T
  loss_T = -(low * sum_log_probs_T - (confidence - low) * nll_T) - entropy
  metrics = {'loss': (loss_T * weights_T).sum(), 'nll': (nll_T * weights_T).sum(),
             'correct': ((target_T >= 0) * weights_T).sum(), 'weight': weights_T.sum()}
  is_target_TV = jax.lax.broadcasted_iota(jnp.int32, logits_TV.shape, 1) == targets_T[:, None]
  smoothed_TV = jnp.where(is_target_TV, confidence, low)
  grad_TV = (exp_TV / sum_exp_T[:, None] - smoothed_TV) * weights_T[:, None]
  return metrics, grad_TV


def chunked_metrics(project, weights, hidden_BLE: jax.Array, targets_BL: jax.Array,
                    label_smoothing: float, chunk_tokens: int) -> dict[str, jax.Array]:
  """`compute_metrics(project(weights, hidden_BLE), ...)` holding one chunk's logits at a time.

  The B x L tokens are split into U = ceil(B L / chunk_tokens) chunks of at most
  `chunk_tokens` (the last padded with PAD targets, which count for nothing); chunk u holds
  tokens u, u + U, u + 2U, ..., so each chunk is split over the devices as the batch is. A scan
  projects one chunk to its [T, V] logits and sums its metrics. Differentiating the scan as it
  stands would keep every chunk's logits for the backward pass, so a custom VJP instead takes
  each chunk's gradient while its logits are live (d loss / d logits from
  `metrics_and_logits_grad`, then the projection's VJP to the weights and hidden states) and
  keeps only those: [V, E] and [B L, E]. Unlike rematerialising each chunk, nothing is
  projected twice. The sums equal the full path's up to float32 rounding; only 'loss' is
  differentiable.

  The logits may come in a narrower dtype than float32 (bfloat16: half the bytes of the
  [T, V] arrays the projection writes and its backward reads); the softmax, the sums and the
  logits' gradient are computed in float32 from them, and that gradient is handed to the
  projection's backward in the logits' dtype.

  Args:
    project: (weights, hidden_TE) -> logits_TV, the model's output layer.
    weights: the parameters `project` reads (a pytree).
  """
  tokens, width = targets_BL.size, hidden_BLE.shape[-1]
  num_chunks = -(-tokens // chunk_tokens)
  size = -(-tokens // num_chunks)  # The fewest PAD tokens for chunks of at most chunk_tokens.
  padding = num_chunks * size - tokens
  hidden_TE = jnp.pad(hidden_BLE.reshape(tokens, width), ((0, padding), (0, 0)))
  targets_T = jnp.pad(targets_BL.reshape(tokens), (0, padding), constant_values=PAD_ID)
  hidden_UTE = nn.with_logical_constraint(
      hidden_TE.reshape(size, num_chunks, width).swapaxes(0, 1), (None, 'batch', 'embed'))
  targets_UT = nn.with_logical_constraint(
      targets_T.reshape(size, num_chunks).swapaxes(0, 1), (None, 'batch'))
  sums = _chunked_sums(project, label_smoothing, weights, hidden_UTE, targets_UT)
  return {'loss': sums['loss'], **jax.lax.stop_gradient(
      {name: sums[name] for name in ('nll', 'correct', 'weight')})}


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked_sums(project, label_smoothing, weights, hidden_UTE, targets_UT):
  """Metric sums over the chunks; see `chunked_metrics`."""
  def add_chunk(sums, chunk):
    hidden_TE, targets_T = chunk
    metrics, _ = metrics_and_logits_grad(project(weights, hidden_TE), targets_T,
                                         label_smoothing)
    return jax.tree.map(jnp.add, sums, metrics), None
  sums, _ = jax.lax.scan(add_chunk, _zero_sums(), (hidden_UTE, targets_UT))
  return sums


def _chunked_sums_forward(project, label_smoothing, weights, hidden_UTE, targets_UT):
  """The sums, plus d loss / d weights and d loss / d hidden taken chunk by chunk."""
  def add_chunk(carry, chunk):
    sums, weights_grad = carry
    hidden_TE, targets_T = chunk
    logits_TV, project_vjp = jax.vjp(project, weights, hidden_TE)
    metrics, logits_grad_TV = metrics_and_logits_grad(logits_TV, targets_T, label_smoothing)
    # In the logits' dtype, as the projection's backward matmuls read it.
    chunk_weights_grad, hidden_grad_TE = project_vjp(logits_grad_TV.astype(logits_TV.dtype))
    carry = (jax.tree.map(jnp.add, sums, metrics),
             jax.tree.map(jnp.add, weights_grad, chunk_weights_grad))
    return carry, hidden_grad_TE

  (sums, weights_grad), hidden_grad_UTE = jax.lax.scan(
      add_chunk, (_zero_sums(), jax.tree.map(jnp.zeros_like, weights)),
      (hidden_UTE, targets_UT))
  return sums, (weights_grad, hidden_grad_UTE)


def _chunked_sums_backward(project, label_smoothing, residuals, sums_grad):
  del project, label_smoothing  # Only the nondifferentiable arguments' places.
  weights_grad, hidden_grad_UTE = residuals
  scale = sums_grad['loss']  # The other sums are stop_gradient-ed by `chunked_metrics`.
  return (jax.tree.map(lambda g: (g * scale).astype(g.dtype), weights_grad),
          (hidden_grad_UTE * scale).astype(hidden_grad_UTE.dtype), None)


_chunked_sums.defvjp(_chunked_sums_forward, _chunked_sums_backward)


def _zero_sums() -> dict[str, jax.Array]:
  return {name: jnp.zeros((), jnp.float32) for name in ('loss', 'nll', 'correct', 'weight')}


def summarize(metric_sums: dict[str, float]) -> dict[str, float]:
  """Loss, accuracy and perplexity per real target token (and MoE figures) from summed metrics."""
  weight = max(float(metric_sums['weight']), 1.0)
  nll = float(metric_sums['nll']) / weight
  figures = {'loss': float(metric_sums['loss']) / weight,
             'accuracy': float(metric_sums['correct']) / weight,
             'perplexity': float(np.exp(min(nll, 50.0)))}
  # Second objectives of pre-training, per their own count: BERT's next-sentence pairs,
  # ELECTRA's replaced-token detection over every real token (training/encoder_tasks.py).
  for second in ('next_sentence', 'replaced'):
    if f'{second}_weight' in metric_sums:
      count = max(float(metric_sums[f'{second}_weight']), 1.0)
      figures[f'{second}_loss'] = float(metric_sums[f'{second}_loss']) / count
      figures[f'{second}_accuracy'] = float(metric_sums[f'{second}_correct']) / count
  if 'moe_aux_loss' in metric_sums:  # Mixture of experts: balance and overflow (moe.py).
    figures['moe_aux_loss'] = float(metric_sums['moe_aux_loss']) / weight
    figures['moe_dropped_fraction'] = (float(metric_sums['moe_dropped'])
                                       / max(float(metric_sums['moe_routed']), 1.0))
  return figures


SCHEDULES = ('rsqrt', 't2t', 'constant', 'linear', 'cosine')


def learning_rate_schedule(opt_config, d_model: int,
                           num_steps: int | None = None) -> optax.Schedule:
  """Maps the optimiser step (0-based, as optax counts) to a learning rate.

  With s = step + 1 (the update's number) and W = warmup: 'rsqrt' is the paper's
  scale * d^-0.5 * min(s^-0.5, s * W^-1.5); 't2t' is tensor2tensor's constant * linear_warmup *
  rsqrt_decay * rsqrt_hidden_size, that is scale * d^-0.5 * min(1, s / W) / sqrt(max(s, W));
  'constant' is just scale. 'linear' and 'cosine' warm up linearly to the rsqrt schedule's
  peak, scale * d^-0.5 * W^-0.5 (so lr_scale means the same in all three), then fall over
  the remaining updates to `final_lr_fraction` of it, reached at update num_steps + 1 (the
  first one not run, so the last update still moves the weights).

  `cooldown_steps` C > 0 multiplies any of them by min(1, (num_steps + 1 - s) / C): a linear
  cooldown to 0 over the last C updates, which lets the rsqrt schedule end at a budget.
  """
  scale, warmup = opt_config.lr_scale, float(opt_config.warmup_steps)
  name, cooldown = opt_config.schedule, opt_config.get('cooldown_steps', 0)  # Older configs.
  if name not in SCHEDULES:
    raise ConfigError(f'config.opt.schedule must be one of {SCHEDULES}, got {name!r}')
  if (name in ('linear', 'cosine') or cooldown) and num_steps is None:
    raise ValueError(f'the {name!r} schedule with cooldown_steps={cooldown} needs num_steps')
  if name in ('linear', 'cosine') and warmup >= num_steps:
    raise ConfigError(f'config.opt.schedule={name!r} decays after the warmup: '
                      f'config.opt.warmup_steps={opt_config.warmup_steps} must be below '
                      f'config.train.num_steps={num_steps}')
  if cooldown > (num_steps or 0):
    raise ConfigError(f'config.opt.cooldown_steps={cooldown} must not exceed '
                      f'config.train.num_steps={num_steps}')
  final = opt_config.get('final_lr_fraction', 0.0)

  def base(s):
    if name == 'rsqrt':
      return scale * d_model**-0.5 * jnp.minimum(s**-0.5, s * warmup**-1.5)
    if name == 't2t':
      return (scale * d_model**-0.5 * jnp.minimum(1.0, s / warmup)
              * jax.lax.rsqrt(jnp.maximum(s, warmup)))
    if name == 'constant':
      return jnp.full_like(s, scale)
    peak = scale * d_model**-0.5 * warmup**-0.5
    progress = jnp.clip((s - warmup) / (num_steps + 1 - warmup), 0.0, 1.0)
    if name == 'linear':
      decay = 1.0 - progress
    else:
      decay = 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    return peak * jnp.where(s < warmup, s / warmup, final + (1.0 - final) * decay)

  def schedule(step):
    s = jnp.asarray(step, jnp.float32) + 1.0
    rate = base(s)
    if cooldown:
      rate = rate * jnp.clip((num_steps + 1 - s) / cooldown, 0.0, 1.0)
    return rate

  return schedule


def make_optimizer(opt_config, d_model: int,
                   num_steps: int | None = None) -> optax.GradientTransformation:
  """Adam (or AdamW with weight decay) under the schedule, optionally clipped first.

  opt.decay_vectors=False keeps weight decay off every parameter of fewer than two axes per
  layer (biases, layer-norm scales; BERT's recipe). opt.layer_lr_decay < 1 scales each update
  by its layer's factor (`layer_rate_factors`). opt.frozen names top-level parameters
  (comma-separated, such as 'embedding,embedder,type_embedding') that stay as they start:
  their gradients are zeroed before the clipped norm and Adam (whose moments for them stay 0)
  and their updates, weight decay included, after it.
  """
  schedule = learning_rate_schedule(opt_config, d_model, num_steps)
  decay_vectors = opt_config.get('decay_vectors', True)  # Configs saved before the key.
  mask = None if decay_vectors else _decays_matrices_only
  adam = optax.adamw(schedule, b1=opt_config.b1, b2=opt_config.b2, eps=opt_config.eps,
                     weight_decay=opt_config.weight_decay, mask=mask)
  layer_decay = opt_config.get('layer_lr_decay', 1.0)
  if not 0.0 < layer_decay <= 1.0:
    raise ConfigError(f'config.opt.layer_lr_decay={layer_decay} must be in (0, 1]; 1.0 is off')
  if layer_decay < 1.0:
    adam = optax.chain(adam, _scale_by_layer(layer_decay))
  if opt_config.grad_clip > 0:
    adam = optax.chain(optax.clip_by_global_norm(opt_config.grad_clip), adam)
  frozen = _frozen_names(opt_config)
  if frozen:  # Zero gradients in (out of the clipped norm), and no weight decay out.
    adam = optax.chain(_zero_frozen(frozen), adam, _zero_frozen(frozen))
  return adam


def _frozen_names(opt_config) -> tuple[str, ...]:
  """The top-level parameter names opt.frozen lists."""
  return tuple(name for name in (part.strip() for part in
                                 opt_config.get('frozen', '').split(',')) if name)


def _zero_frozen(frozen: tuple[str, ...]) -> optax.GradientTransformation:
  """Sets the updates (or gradients) under the top-level names in `frozen` to 0; keeps no
  state. Its init refuses a name the model does not have."""
  def init(params):
    unknown = [name for name in frozen if name not in params]
    if unknown:
      raise ConfigError(f'config.opt.frozen={",".join(frozen)!r}: this model has no parameters '
                        f'named {", ".join(unknown)}; its top-level names are '
                        f'{", ".join(sorted(params))}')
    return optax.EmptyState()

  def update(updates, state, params=None):
    del params
    return {name: jax.tree.map(jnp.zeros_like, subtree) if name in frozen else subtree
            for name, subtree in updates.items()}, state
  return optax.GradientTransformation(init, update)


def _decays_matrices_only(params):
  """The weight-decay mask of opt.decay_vectors=False: True on the parameters of two or more
  axes, not counting the leading layer axis of scan_layers' stacks ('encoder_layers',
  'decoder_layers'), whose biases and norm scales are vectors of each layer."""
  def decays(path, param):
    stacked = str(getattr(path[0], 'key', '')).endswith('_layers')
    return jnp.ndim(param) - stacked >= 2
  return jax.tree_util.tree_map_with_path(decays, params)


def layer_rate_factors(params, decay: float):
  """Per parameter, its learning-rate factor under layer-wise decay: encoder layer i of n
  ('encoder_<i>') decay^(n - i), the embeddings ('embedding', 'type_embedding') decay^(n + 1),
  everything else (the final norm, pooler, heads) 1. Stacked layers ('encoder_layers', a
  leading axis of n) get a factor per layer, broadcast over the rest."""
  names = set(params)
  layers = sum(1 for name in names if name.startswith('encoder_') and name[8:].isdigit())
  if 'encoder_layers' in names:
    layers = jax.tree.leaves(params['encoder_layers'])[0].shape[0]

  def factor(name, leaf):
    if name.startswith('encoder_') and name[8:].isdigit():
      return jnp.asarray(decay ** (layers - int(name[8:])), jnp.float32)
    if name == 'encoder_layers':
      per_layer = decay ** (layers - jnp.arange(layers, dtype=jnp.float32))
      return per_layer.reshape((layers,) + (1,) * (jnp.ndim(leaf) - 1))
    if name in ('embedding', 'type_embedding', 'source_embedding', 'embedder'):
      return jnp.asarray(decay ** (layers + 1), jnp.float32)
    return jnp.asarray(1.0, jnp.float32)
  return {name: jax.tree.map(lambda leaf, name=name: factor(name, leaf), subtree)
          for name, subtree in params.items()}


def _scale_by_layer(decay: float) -> optax.GradientTransformation:
  """Multiplies each update by `layer_rate_factors`; keeps no state."""
  def update(updates, state, params=None):
    del params
    factors = layer_rate_factors(updates, decay)
    return jax.tree.map(lambda u, f: (u * f).astype(u.dtype), updates, factors), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def ema_init(params):
  """The moving average's start: a float32 copy of the parameters.

  A copy, never the same buffers, so a donated train state does not hold one buffer twice.
  """
  return jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), params)


def ema_update(ema, params, decay: float):
  """ema <- decay * ema + (1 - decay) * params, in float32 (opt.ema_decay).

  A plain exponential moving average, no warmup and no debiasing: after n updates it is
  decay^n * p_0 + (1 - decay) * sum_k decay^(n-k) * p_k, so the initial weights fade out over
  about 1 / (1 - decay) steps; choose decay so that is well below train.num_steps.
  """
  as_float32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
  return optax.incremental_update(as_float32, ema, 1.0 - decay)
