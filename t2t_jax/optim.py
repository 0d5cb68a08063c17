"""Label-smoothed loss, learning-rate schedules and the optax chain."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t2t_jax import PAD_ID


def smoothed_cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array,
                           label_smoothing: float) -> tuple[jax.Array, jax.Array]:
  """Per-token label-smoothed cross-entropy and the non-pad weights.

  The target gets `1 - label_smoothing`, every other entry `label_smoothing / (V - 1)`.
  The entropy of that distribution is subtracted, so a prediction equal to it scores 0.
  Written without a one-hot [B, L, V] tensor: sum_v q_v log p_v = low * sum_v log p_v +
  (confidence - low) * log p_target.
  """
  vocab_size = logits_BLV.shape[-1]
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab_size - 1)
  log_probs_BLV = jax.nn.log_softmax(logits_BLV.astype(jnp.float32))
  target_log_prob_BL = jnp.take_along_axis(log_probs_BLV, targets_BL[..., None], -1)[..., 0]
  cross_entropy_BL = -(low * log_probs_BLV.sum(-1) + (confidence - low) * target_log_prob_BL)
  entropy = -(confidence * np.log(confidence) + (vocab_size - 1) * low * np.log(low + 1e-20))
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


def summarize(metric_sums: dict[str, float]) -> dict[str, float]:
  """Loss, accuracy and perplexity per real target token from summed metrics."""
  weight = max(float(metric_sums['weight']), 1.0)
  nll = float(metric_sums['nll']) / weight
  return {'loss': float(metric_sums['loss']) / weight,
          'accuracy': float(metric_sums['correct']) / weight,
          'perplexity': float(np.exp(min(nll, 50.0)))}


def learning_rate_schedule(opt_config, d_model: int) -> optax.Schedule:
  """Maps the optimiser step (0-based, as optax counts) to a learning rate.

  'rsqrt' is the paper's scale * d^-0.5 * min(s^-0.5, s * warmup^-1.5) at s = step + 1;
  't2t' is tensor2tensor's constant * linear_warmup * rsqrt_decay * rsqrt_hidden_size, that is
  scale * d^-0.5 * min(1, s / warmup) / sqrt(max(s, warmup)); 'constant' is just scale.
  """
  scale, warmup = opt_config.lr_scale, float(opt_config.warmup_steps)
  if opt_config.schedule == 'rsqrt':
    def schedule(step):
      s = jnp.asarray(step, jnp.float32) + 1.0
      return scale * d_model**-0.5 * jnp.minimum(s**-0.5, s * warmup**-1.5)
  elif opt_config.schedule == 't2t':
    def schedule(step):
      s = jnp.asarray(step, jnp.float32) + 1.0
      return (scale * d_model**-0.5 * jnp.minimum(1.0, s / warmup)
              * jax.lax.rsqrt(jnp.maximum(s, warmup)))
  elif opt_config.schedule == 'constant':
    schedule = optax.constant_schedule(scale)
  else:
    raise ValueError(f"config.opt.schedule must be 'rsqrt', 't2t' or 'constant', "
                     f'got {opt_config.schedule!r}')
  return schedule


def make_optimizer(opt_config, d_model: int) -> optax.GradientTransformation:
  """Adam (or AdamW with weight decay) under the schedule, optionally clipped first."""
  schedule = learning_rate_schedule(opt_config, d_model)
  adam = optax.adamw(schedule, b1=opt_config.b1, b2=opt_config.b2, eps=opt_config.eps,
                     weight_decay=opt_config.weight_decay)
  if opt_config.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(opt_config.grad_clip), adam)
  return adam
