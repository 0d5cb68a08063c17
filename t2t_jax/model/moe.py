"""Mixture-of-experts feed-forward layers: top-k gating, expert capacity, load balancing.

A router scores each token against X experts (Shazeer et al. 2017); the token goes to its P
best (Switch Transformer: P=1, GShard: P=2), each expert a ReLU feed-forward network of
width d_ff. Routing groups are the batch rows, or groups of `moe_group_size` tokens of a row:
an expert takes at most ceil(capacity_factor x n x P / X) tokens of a group holding n real
(non-padding) tokens, and a choice past that is dropped (its share of the output is zero, so
the residual connection carries the token). Counting real tokens, not the group's width, keeps
a sentence's output independent of how far its batch pads it. Dispatch and combine are
one-hot einsums as in GShard, so the experts' [X, ...] weights and their inputs split over an
'expert' mesh axis through the logical-axis rules, like every other weight.

Shapes in names follow the package legend (t2t_jax/__init__.py): X experts, P experts picked
per token (top-k), A slots per expert and group (the capacity of a group with no padding).
"""

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from t2t_jax import ConfigError
from t2t_jax.model.relu_dropout import ReluDropout

Array = jax.Array
COLLECTION = 'moe'  # Flax collection the layers sow their loss and counts into.
LAYER_PATTERNS = ('all', 'every_other')


def layer_indices(pattern: str, num_layers: int) -> tuple[int, ...]:
  """The layers of a stack of `num_layers` that config.model.moe_layers makes MoE layers.

  'every_other' is GShard's choice: layers 1, 3, 5, ... (counted from 0), each MoE layer
  following a dense one.
  """
  if pattern == 'all':
    return tuple(range(num_layers))
  if pattern == 'every_other':
    return tuple(range(1, num_layers, 2))
  try:
    indices = tuple(int(part) for part in pattern.split(','))
  except ValueError:
    raise ConfigError(f'config.model.moe_layers={pattern!r} must be one of {LAYER_PATTERNS} or '
                      "comma-separated layer indices such as '0,2'") from None
  return tuple(i for i in indices if i < num_layers)


def check(config) -> None:
  """Refuses MoE settings of a model config (TransformerConfig) that cannot work."""
  if config.moe_experts < 0:
    raise ConfigError(f'config.model.moe_experts={config.moe_experts} must be 0 (dense) or a '
                      'positive number of experts')
  if not config.moe_experts:
    return
  if not 1 <= config.moe_top_k <= config.moe_experts:
    raise ConfigError(f'config.model.moe_top_k={config.moe_top_k} must be between 1 and '
                      f'config.model.moe_experts={config.moe_experts}')
  deepest = max(config.num_encoder_layers, config.num_decoder_layers)
  indices = layer_indices(config.moe_layers, deepest)
  if config.moe_layers not in LAYER_PATTERNS:
    given = [int(part) for part in config.moe_layers.split(',')]
    if len(indices) != len(given) or min(given) < 0:
      raise ConfigError(f'config.model.moe_layers={config.moe_layers!r} names a layer outside '
                        f'0..{deepest - 1}, the layers of the deepest stack')
  if config.scan_layers and config.moe_layers != 'all':
    raise ConfigError(f'config.model.scan_layers=True repeats one compiled layer, so it needs '
                      f"config.model.moe_layers='all', got {config.moe_layers!r}; set "
                      "moe_layers='all' or scan_layers=False")


def uses_moe(config, index: int, num_layers: int) -> bool:
  """Whether layer `index` of a stack of `num_layers` has a mixture of experts."""
  return bool(config.moe_experts) and index in layer_indices(config.moe_layers, num_layers)


def expert_capacity(length: int, experts: int, top_k: int, capacity_factor: float) -> int:
  """Slots per expert for a row of `length` tokens; capacity_factor <= 0 means no limit.

  No expert can receive more than `length` tokens of a row (a token's P experts differ), so
  that is both the cap and the 'no limit' value.
  """
  if capacity_factor <= 0:
    return length
  return max(1, min(length, math.ceil(capacity_factor * length * top_k / experts)))


def route(probs_BLX: Array, valid_BL: Array, top_k: int, capacity: int,
          capacity_B: Array | None = None):
  """Top-k routing with capacity: (dispatch_BLXA, combine_BLXA, expert_BLP, kept_BLP).

  Each row has `capacity` slots per expert, of which an expert fills at most `capacity_B`
  (each row's own limit, at most `capacity`; None: all of them).

  Combine weights: with P=1 the chosen expert's router probability (Switch: the gradient
  reaches the router through it); with P>1 the P probabilities renormalised to sum to 1
  (GShard), and a dropped choice's weight is not handed to the others. Slots are filled in
  token order, a token's choices in rank order, so whether a token keeps its slot depends
  only on the tokens before it in its row: causal decoders stay causal. Invalid (padding)
  tokens are routed nowhere: they take no slot and get a zero output.
  """
  experts = probs_BLX.shape[-1]
  gate_BLP, expert_BLP = jax.lax.top_k(probs_BLX, top_k)
  if top_k > 1:
    gate_BLP = gate_BLP / gate_BLP.sum(-1, keepdims=True)
  choice_BLPX = jax.nn.one_hot(expert_BLP, experts, dtype=jnp.int32) * valid_BL[..., None, None]
  batch, length = valid_BL.shape
  # Slot of each choice in its expert: how many choices of the row went there before it.
  earlier_BLPX = jnp.cumsum(choice_BLPX.reshape(batch, length * top_k, experts), axis=1)
  position_BLPX = earlier_BLPX.reshape(choice_BLPX.shape) - 1
  taken_BLPX = choice_BLPX > 0
  if capacity_B is not None:
    taken_BLPX &= position_BLPX < capacity_B[:, None, None, None]
  # one_hot gives a zero row for positions >= capacity (dropped) and -1 (not chosen).
  slot_BLPXA = jax.nn.one_hot(jnp.where(taken_BLPX, position_BLPX, -1), capacity,
                              dtype=jnp.float32)
  dispatch_BLXA = slot_BLPXA.sum(2)  # A token's P experts differ: still 0 or 1.
  combine_BLXA = jnp.einsum('BLK,BLKXC->BLXC', gate_BLP, slot_BLPXA)
  kept_BLP = slot_BLPXA.sum((3, 4))
  return dispatch_BLXA, combine_BLXA, expert_BLP, kept_BLP


def load_balancing_loss(probs_BLX: Array, expert_BLP: Array, valid_BL: Array) -> Array:
  """Switch Transformer's auxiliary loss: X * sum_e (fraction of choices to e) (mean prob of e).

  Both factors are taken over the valid tokens of the whole batch, the fraction over all P
  choices before any are dropped (so it sums to 1 and the loss is 1 at perfect balance). Only
  the mean probability carries a gradient.
  """
  experts = probs_BLX.shape[-1]
  valid_BL = valid_BL.astype(jnp.float32)
  tokens = jnp.maximum(valid_BL.sum(), 1.0)
  choices_BLX = jax.nn.one_hot(expert_BLP, experts).sum(2)
  fraction_X = jnp.einsum('BLX,BL->X', choices_BLX, valid_BL) / (tokens * expert_BLP.shape[-1])
  mean_prob_X = jnp.einsum('BLX,BL->X', probs_BLX, valid_BL) / tokens
  return experts * jnp.sum(fraction_X * mean_prob_X)


class MoeFeedForward(nn.Module):
  """X expert ReLU feed-forward networks behind a top-k router; a drop-in for FeedForward.

  Sows into the 'moe' collection (read by `metrics`) the layer's load-balancing loss and its
  counts of routed and dropped choices of valid tokens, and into 'intermediates' the router
  probabilities and choices.
  """
  config: Any  # model.TransformerConfig

  @nn.compact
  def __call__(self, x_BLE: Array, valid_BL: Array | None = None) -> Array:
    """`valid_BL` marks the real tokens (None: all); padding takes no expert capacity."""
    cfg = self.config
    experts, width, hidden = cfg.moe_experts, cfg.d_model, cfg.d_ff
    if valid_BL is None:
      valid_BL = jnp.ones(x_BLE.shape[:2], bool)

    # The router runs in float32 (Switch Transformer): rounding in bfloat16 logits flips
    # choices. A small initial scale keeps the first routing near uniform.
    router_EX = self.param(
        'router', nn.with_logical_partitioning(
            nn.initializers.variance_scaling(0.1, 'fan_in', 'truncated_normal'),
            ('embed', None)), (width, experts), cfg.param_dtype)
    logits_BLX = jnp.einsum('BLE,EX->BLX', x_BLE.astype(jnp.float32),
                            router_EX.astype(jnp.float32))
    probs_BLX = jax.nn.softmax(logits_BLX)
    rows, length = x_BLE.shape[:2]
    # Routing groups of config.model.moe_group_size tokens (0: the row) become the rows from
    # here on, so the dispatch tensor [groups, group size, X, A] grows linearly with length.
    group = cfg.moe_group_size or length
    x_BLE, probs_BLX, valid_BL = (_groups(a, group) for a in (x_BLE, probs_BLX, valid_BL))
    capacity = expert_capacity(group, experts, cfg.moe_top_k, cfg.moe_capacity_factor)
    dispatch_BLXA, combine_BLXA, expert_BLP, kept_BLP = route(
        probs_BLX, valid_BL, cfg.moe_top_k, capacity, _group_capacities(valid_BL, cfg))

    routed = valid_BL.sum().astype(jnp.float32) * cfg.moe_top_k
    self.sow(COLLECTION, 'aux_loss', load_balancing_loss(probs_BLX, expert_BLP, valid_BL))
    self.sow(COLLECTION, 'routed', routed)
    self.sow(COLLECTION, 'dropped', routed - kept_BLP.sum())
    self.sow('intermediates', 'router_probs', probs_BLX)
    self.sow('intermediates', 'expert_index', expert_BLP)

    def param(name, init, shape, names):
      return self.param(name, nn.with_logical_partitioning(init, names), shape,
                        cfg.param_dtype).astype(cfg.dtype)
    # Each expert's kernel is initialised as FeedForward's is: Xavier over its own fans.
    kernel_init = nn.initializers.xavier_uniform(in_axis=1, out_axis=2, batch_axis=(0,))
    zeros = nn.initializers.zeros
    wi_XEF = param('wi_kernel', kernel_init, (experts, width, hidden), ('expert', 'embed', 'mlp'))
    bi_XF = param('wi_bias', zeros, (experts, hidden), ('expert', 'mlp'))
    wo_XFE = param('wo_kernel', kernel_init, (experts, hidden, width), ('expert', 'mlp', 'embed'))
    bo_XE = param('wo_bias', zeros, (experts, width), ('expert', 'embed'))

    # Each expert's slots, gathered from the rows: with the rules this is the all-to-all
    # from rows split over the batch axes to experts split over 'expert'.
    x_XBAE = jnp.einsum('BLXC,BLE->XBCE', dispatch_BLXA.astype(cfg.dtype),
                        x_BLE.astype(cfg.dtype))
    x_XBAE = nn.with_logical_constraint(x_XBAE, ('expert', 'batch', None, 'embed'))
    h_XBAF = jnp.einsum('XBCE,XEF->XBCF', x_XBAE, wi_XEF) + bi_XF[:, None, None, :]
    h_XBAF = nn.with_logical_constraint(h_XBAF, ('expert', 'batch', None, 'mlp'))
    h_XBAF = ReluDropout(cfg.relu_dropout, name='Dropout_0')(h_XBAF, cfg.deterministic)
    y_XBAE = jnp.einsum('XBCF,XFE->XBCE', h_XBAF, wo_XFE) + bo_XE[:, None, None, :]
    y_XBAE = nn.with_logical_constraint(y_XBAE, ('expert', 'batch', None, 'embed'))
    # Empty slots hold bias-only outputs; their combine weight is zero.
    y_BLE = jnp.einsum('XBCE,BLXC->BLE', y_XBAE, combine_BLXA.astype(cfg.dtype))
    y_BLE = y_BLE.reshape(rows, -1, width)[:, :length]  # The rows again, group padding cut.
    return nn.with_logical_constraint(y_BLE, ('batch', 'length', 'embed'))


def _group_capacities(valid_BL: Array, cfg) -> Array:
  """Each routing group's limit from its real tokens: `expert_capacity` of their count."""
  by_count = [expert_capacity(n, cfg.moe_experts, cfg.moe_top_k, cfg.moe_capacity_factor)
              for n in range(valid_BL.shape[1] + 1)]
  return jnp.asarray(by_count)[valid_BL.sum(-1)]


def _groups(x_BL: Array, group: int) -> Array:
  """[B, L, ...] as routing groups [B * ceil(L / group), group, ...]; the padding added to fill
  the last group is zero (False: not a valid token, so it takes no expert slot)."""
  padding = -x_BL.shape[1] % group
  if padding:
    x_BL = jnp.pad(x_BL, [(0, 0), (0, padding)] + [(0, 0)] * (x_BL.ndim - 2))
  return x_BL.reshape((-1, group) + x_BL.shape[2:])


def metrics(collection) -> dict[str, Array]:
  """The sown 'moe' collection of a model call as {'aux_loss', 'routed', 'dropped'}.

  'aux_loss' is the mean of the MoE layers' losses (encoder and decoder alike), so its weight
  means the same whatever the number of MoE layers; the counts are sums over the layers.
  """
  values = {'aux_loss': [], 'routed': [], 'dropped': []}
  for path, leaf in jax.tree_util.tree_flatten_with_path(collection)[0]:
    names = [key.key for key in path if isinstance(key, jax.tree_util.DictKey)]
    values[names[-1]].append(jnp.ravel(leaf))  # Scanned layers sow one value per layer.
  if not values['aux_loss']:
    zero = jnp.zeros((), jnp.float32)
    return {'aux_loss': zero, 'routed': zero, 'dropped': zero}
  return {'aux_loss': jnp.concatenate(values['aux_loss']).mean(),
          'routed': jnp.concatenate(values['routed']).sum(),
          'dropped': jnp.concatenate(values['dropped']).sum()}
