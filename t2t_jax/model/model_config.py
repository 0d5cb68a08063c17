"""The model's static configuration, built and checked from the `model` section of a config:
which family members (positions, attention pattern and implementation, experts) run together."""

import dataclasses
import functools
from typing import Any

from absl import logging
import jax
import jax.numpy as jnp

from t2t_jax import ConfigError
from t2t_jax import with_current_keys
from t2t_jax.model import moe
from t2t_jax.model.attention import SEGMENT_ID_IMPLS
from t2t_jax.model.attention import attention_kinds
from t2t_jax.model.positions import check_positions

# config.model.remat -> what the backward pass keeps of each layer (the rest is recomputed).
# 'dots' keeps the outputs of the weight matmuls (projections, feed-forward), most of a
# layer's FLOPs, but not the batched query-key and weight-value products: their [B, H, Q, K]
# operands grow with length squared and they are a few percent of the FLOPs at these widths.
REMAT_POLICIES = {
    'none': None,
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
  """Static hyperparameters, resolved (never 'auto'); `deterministic` and `decode` select the
  mode. The defaults are configs/base.py's model section resolved on a CPU (a test holds them
  equal)."""
  vocab_size: int
  d_model: int = 512
  d_ff: int = 2048
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  dropout: float = 0.1
  attention_dropout: float = 0.1
  relu_dropout: float = 0.1
  share_embeddings: bool = True
  tie_output: bool = True
  norm: str = 'post'
  max_len: int = 512
  scan_layers: bool = False
  remat: str = 'none'
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  # Resolved: 'einsum', 'xla', 'cudnn', 'pallas' or 'flash' (never 'auto').
  attention_impl: str = 'einsum'
  positions: str = 'sinusoidal'
  max_relative_distance: int = 16
  attention_pattern: str = 'full'
  local_half_width: int = 256
  compression_stride: int = 3
  kind: str = 'encoder_decoder'  # Or 'decoder_only', 'encoder_only'; `make_model` picks.
  prefix_attention: str = 'causal'  # Decoder-only: how the source attends ('causal', 'full').
  # Encoder-only: 'mlm', 'electra', 'classification' or 'regression' (encoder_only.py).
  head: str = 'mlm'
  num_labels: int = 0  # Encoder-only classification: the label set's size (config.data.labels).
  type_vocab_size: int = 0  # Encoder-only: token-type (segment) embeddings; 0: none.
  pooling: str = 'cls'  # Encoder-only heads: the first token's state ('cls') or the 'mean'.
  next_sentence: bool = False  # Encoder-only 'mlm' head: also next-sentence prediction (BERT).
  generator_layers: int = 1  # Encoder-only 'electra' head: the generator's layers.
  moe_experts: int = 0  # Mixture of experts (moe.py); 0: dense feed-forward layers.
  moe_top_k: int = 2
  moe_capacity_factor: float = 1.25
  moe_layers: str = 'every_other'
  moe_group_size: int = 0  # Tokens per routing group; 0: each batch row is one group.
  deterministic: bool = False
  decode: bool = False

  @classmethod
  def from_config(cls, model_config, vocab_size: int, platform: str | None = None,
                  **overrides) -> 'TransformerConfig':
    """Builds from the `model` section of an ml_collections config.

    'auto' settings resolve for `platform` ('cpu', 'gpu', 'tpu'): the platform of the devices
    the model runs on (resolve.py), which a dry run for a named target gives. None: not known
    yet (checking a config before any device is chosen, as t2t_jax.prepare does): 'auto'
    resolves as on a CPU and the checks that depend on the platform wait for one.
    """
    if model_config.d_model % model_config.num_heads:
      raise ConfigError(f'config.model.d_model={model_config.d_model} is not divisible by '
                        f'config.model.num_heads={model_config.num_heads}')
    if model_config.norm not in ('post', 'pre'):
      raise ConfigError(f"config.model.norm must be 'post' or 'pre', got {model_config.norm!r}")
    given = with_current_keys({'model': dict(model_config.items())})['model']
    kwargs = {f.name: given[f.name] for f in dataclasses.fields(cls) if f.name in given}
    kwargs['dtype'] = compute_dtype(kwargs['dtype'], platform)
    kwargs['param_dtype'] = jnp.dtype(kwargs['param_dtype'])
    if kwargs.get('kind', cls.kind) not in MODEL_KINDS:
      raise ConfigError(f'config.model.kind={kwargs["kind"]!r} must be one of {MODEL_KINDS}')
    if kwargs.get('prefix_attention', cls.prefix_attention) not in PREFIX_ATTENTION:
      raise ConfigError(f'config.model.prefix_attention={kwargs["prefix_attention"]!r} must be '
                        f'one of {PREFIX_ATTENTION}')
    if kwargs.get('kind') == 'decoder_only':  # One stack: the encoder's depth does not apply.
      kwargs['num_encoder_layers'] = 0
    if kwargs.get('kind') == 'encoder_only':  # One stack: the decoder's depth does not apply.
      kwargs['num_decoder_layers'] = 0
    kwargs['attention_impl'] = resolve_attention_impl(
        model_config.attention_impl, kwargs['dtype'],
        model_config.d_model // model_config.num_heads, model_config.attention_dropout, platform)
    config = cls(vocab_size=vocab_size, **{**kwargs, **overrides})
    # Checked on the result: configs saved before the key existed lack it and mean 'none'.
    if config.remat not in REMAT_POLICIES:
      raise ConfigError(f'config.model.remat must be one of {", ".join(map(repr, REMAT_POLICIES))}'
                        f', got {config.remat!r}')
    check_positions(config.positions)
    check_family(config)
    moe.check(config)
    return config


ATTENTION_IMPLS = ('auto', 'einsum', 'xla', 'cudnn', 'pallas', 'flash')


def resolve_attention_impl(impl: str, dtype, head_dim: int, attention_dropout: float,
                           platform: str) -> str:
  """The attention implementation to run: 'auto' picks the fastest verified one.

  'einsum' is the explicit softmax(QK^T)V with dropout on the weights; 'xla' and 'cudnn' go
  through `jax.nn.dot_product_attention` (cuDNN's fused flash attention on NVIDIA GPUs in
  bfloat16/float16 with head sizes up to 128 in multiples of 8); 'pallas' runs JAX's Pallas
  splash-attention kernel on TPUs (pallas_attention.py), on a CPU in the Pallas interpreter
  (for tests); 'flash' runs t2t_jax's own Pallas kernels (flash_attention.py: Triton on GPUs,
  Mosaic on TPUs), the only fused one with dropout on the weights (its masks drawn by a hash,
  not by nn.Dropout; head sizes powers of two from 16), on a CPU in the interpreter. The others need
  config.model.attention_dropout=0. 'xla' runs the same arithmetic as 'einsum' (measured
  equal on CPU), so 'auto' is 'einsum' until cuDNN passes the equality test on a GPU
  (docs/performance.md); it logs why once.
  """
  if impl not in ATTENTION_IMPLS:
    raise ConfigError(f'config.model.attention_impl={impl!r} must be one of {ATTENTION_IMPLS}')
  cudnn_problem = (
      None if platform is None else  # Not known yet: checked once the devices are.
      f'the platform is {platform}, not gpu' if platform != 'gpu' else
      f'config.model.dtype={jnp.dtype(dtype).name}, not bfloat16 or float16'
      if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16) else
      f'the head size {head_dim} is not a multiple of 8 up to 128'
      if head_dim % 8 or head_dim > 128 else None)
  dropout_problem = (f'config.model.attention_dropout={attention_dropout} is not 0, and fused '
                     'attention has no dropout on its weights' if attention_dropout else None)
  if impl == 'auto':
    why_not = dropout_problem or cudnn_problem or (
        'cuDNN attention applies, but on an H100 with jax 0.11.2 it failed the equality test '
        "against einsum and was no faster at 64-token rows, so only an explicit 'cudnn' runs it")
    if platform is not None:  # Said where it runs, not where a config is only checked.
      _log_once(f"config.model.attention_impl='auto' uses 'einsum' attention: {why_not}.")
    return 'einsum'
  problem = dropout_problem if impl not in ('einsum', 'flash') else None
  if impl == 'cudnn':
    problem = problem or cudnn_problem
  if impl == 'pallas' and platform == 'gpu':
    raise ConfigError("config.model.attention_impl='pallas' runs Pallas TPU kernels (splash "
                      "attention), not GPU ones: use 'cudnn' or 'xla' on a gpu platform.")
  if impl == 'flash' and (head_dim < 16 or head_dim & (head_dim - 1)):
    raise ConfigError(f"config.model.attention_impl='flash' cannot run: the head size "
                      f'{head_dim} (d_model / num_heads) is not a power of two of at least 16, '
                      "as Triton's blocks must be (the TPU kernels keep the same rule). Use "
                      "'einsum' or 'auto'.")
  if impl in SEGMENT_ID_IMPLS and platform == 'cpu' and not problem:
    _log_once(f"config.model.attention_impl={impl!r} runs its kernels in the Pallas "
              'interpreter on cpu: the same arithmetic, slowly (for tests).')
  if problem:
    raise ConfigError(f'config.model.attention_impl={impl!r} cannot run: {problem}. Use '
                      "'auto' (which falls back) or change the setting named.")
  return impl


@functools.cache
def _log_once(message: str) -> None:
  logging.info('%s', message)


MODEL_KINDS = ('encoder_decoder', 'decoder_only', 'encoder_only')  # config.model.kind
HEADS = ('mlm', 'electra', 'classification', 'regression')  # config.model.head (encoder-only)
PRETRAINING_HEADS = ('mlm', 'electra')  # The heads trained on text alone.
POOLING = ('cls', 'mean')  # config.model.pooling (encoder-only heads)
PREFIX_ATTENTION = ('causal', 'full')  # config.model.prefix_attention


def compute_dtype(name: str, platform: str | None):
  """config.model.dtype as a dtype; 'auto' is bfloat16 on accelerators, float32 on CPU (and
  where the platform is not known yet)."""
  if name == 'auto':
    return jnp.dtype(jnp.float32 if platform in ('cpu', None) else jnp.bfloat16)
  if name not in ('float32', 'bfloat16', 'float16'):
    raise ConfigError(f"config.model.dtype={name!r} must be 'float32', 'bfloat16', 'float16' "
                      "or 'auto'")
  return jnp.dtype(name)


def check_family(config) -> None:
  """Raises ConfigError when the attention keys of a model.TransformerConfig cannot run together."""
  kinds = attention_kinds(config.attention_pattern)
  for key in ('local_half_width', 'compression_stride', 'max_relative_distance'):
    if getattr(config, key) < 1:
      raise ConfigError(f'config.model.{key}={getattr(config, key)!r} must be at least 1')
  pattern = f'config.model.attention_pattern={config.attention_pattern!r}'
  if config.positions == 'relative' and 'compressed' in kinds:
    raise ConfigError(f"config.model.positions='relative' cannot be used with {pattern}: a "
                      "compressed key summarises several positions. Use 'full' or 'local' "
                      'layers, or other positions.')
  if config.positions in ('rotary', 'alibi') and 'compressed' in kinds:
    raise ConfigError(f'config.model.positions={config.positions!r} cannot be used with '
                      f'{pattern}: a compressed key summarises several positions, so it has '
                      "no one position to turn or measure from. Use 'full' or 'local' layers, "
                      'or other positions.')
  head_dim = config.d_model // config.num_heads
  if config.positions == 'rotary' and head_dim % 2:
    raise ConfigError(f"config.model.positions='rotary' turns pairs of head dimensions, and "
                      f'd_model / num_heads = {head_dim} is odd: change d_model or num_heads.')
  fused = f'config.model.attention_impl={config.attention_impl!r}'
  if config.attention_impl != 'einsum' and config.positions == 'alibi':
    raise ConfigError(f"{fused} (fused) cannot add ALiBi's bias (config.model.positions="
                      "'alibi'): set attention_impl to 'einsum' or 'auto'.")
  if config.attention_impl != 'einsum' and config.positions == 'relative':
    raise ConfigError(f"{fused} (fused) cannot add relative positions "
                      "(config.model.positions='relative'): set attention_impl to 'einsum' or "
                      "'auto'.")
  if config.attention_impl != 'einsum' and set(kinds) != {'full'}:
    raise ConfigError(f"{fused} (fused) runs 'full' attention only, and {pattern} asks for "
                      "others, which compute their own: set attention_impl to 'einsum' or "
                      "'auto'.")
  if config.attention_impl == 'cudnn' and config.kind == 'decoder_only':
    raise ConfigError(f"{fused} runs the encoder-decoder only: the decoder-only model's "
                      "prefix mask is not given to cuDNN as sequence lengths (only a boolean "
                      "mask, which cuDNN mishandles). Use 'xla', 'einsum' or 'auto'.")
  if (config.attention_impl in SEGMENT_ID_IMPLS and config.kind == 'decoder_only'
      and config.prefix_attention == 'full'):
    raise ConfigError(f"{fused} masks by segment ids and one causal pattern for every row, "
                      "which cannot say that each row's source (of its own length) sees later "
                      "source positions (config.model.prefix_attention='full'): set "
                      "prefix_attention to 'causal', or attention_impl to 'xla' or 'einsum'.")
  if (config.kind == 'decoder_only' and config.prefix_attention == 'full'
      and set(kinds) != {'full'}):
    raise ConfigError(f"config.model.prefix_attention='full' (the source sees later source "
                      f"positions) needs 'full' layers, and {pattern} asks for others, which "
                      "are causal throughout the decoder-only stack: set prefix_attention to "
                      "'causal' or attention_pattern to 'full'.")
  if config.kind == 'encoder_only':
    check_encoder_only(config)
  if config.scan_layers and len(set(kinds)) > 1:
    raise ConfigError(f'config.model.scan_layers=True compiles one layer for a whole stack, so '
                      f'every layer needs the same kind, but {pattern} mixes them: set '
                      'scan_layers=False or use one kind.')


def check_encoder_only(config) -> None:
  """Raises ConfigError when an encoder-only model's head cannot be built."""
  if config.head not in HEADS:
    raise ConfigError(f'config.model.head={config.head!r} must be one of {HEADS}')
  if config.pooling not in POOLING:
    raise ConfigError(f'config.model.pooling={config.pooling!r} must be one of {POOLING}')
  if config.head == 'classification' and config.num_labels < 2:
    raise ConfigError(f'a classifier needs at least 2 labels, and config.data.labels has '
                      f'{config.num_labels}: read them from a training file with 2 or more, '
                      'or list them in config.data.labels')
  if config.next_sentence and config.head != 'mlm':
    raise ConfigError(f"config.model.next_sentence=True is a pre-training objective, and "
                      f"config.model.head={config.head!r}: set it with head='mlm' only")
  if config.head == 'electra' and config.generator_layers < 1:
    raise ConfigError(f'config.model.generator_layers={config.generator_layers} must be at '
                      "least 1 with config.model.head='electra': its generator needs a layer")
  if config.type_vocab_size < 0:
    raise ConfigError(f'config.model.type_vocab_size={config.type_vocab_size} must be 0 (no '
                      'token types) or more')
