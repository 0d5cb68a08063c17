"""Model FLOPs of a train step, published device peaks, and model FLOPs utilisation (MFU).

MFU = (model FLOPs of the work done) / seconds / (peak FLOP/s of the devices doing it), with
model FLOPs counted analytically from the shapes (as in PaLM's appendix B), not from what XLA
happens to execute: recomputation, the optimiser and elementwise work do not count.
"""

import dataclasses
import math
import re

import jax.numpy as jnp

# Published dense (no sparsity) peak FLOP/s per device, by family and compute dtype.
# float32 follows what JAX's default matmul precision lets XLA do: on TPU a float32 matmul
# runs as one bfloat16 pass (bfloat16 peak); on A100/H100/H200 it may use TF32 tensor cores
# (TF32 peak). A run with jax_default_matmul_precision='highest' reaches far less than that.
# Sources: cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}; NVIDIA A100, H100, H200 and HGX B200
# datasheets (the B200's dense figures are half its datasheet's figures with sparsity).
_A100 = {'bfloat16': 312e12, 'float16': 312e12, 'float32': 156e12}  # fp32 without TF32: 19.5e12.
_H100_SXM = {'bfloat16': 989e12, 'float16': 989e12, 'float32': 494.7e12}  # fp32 no TF32: 67e12.
_H100_PCIE = {'bfloat16': 756e12, 'float16': 756e12, 'float32': 378e12}  # fp32 no TF32: 51e12.
PEAK_FLOPS = {
    'tpu_v4': {'bfloat16': 275e12, 'float32': 275e12},
    'tpu_v5e': {'bfloat16': 197e12, 'float32': 197e12},
    'tpu_v5p': {'bfloat16': 459e12, 'float32': 459e12},
    'tpu_v6e': {'bfloat16': 918e12, 'float32': 918e12},
    'a100': _A100,
    'h100_sxm': _H100_SXM,
    'h100_pcie': _H100_PCIE,
    'h200': _H100_SXM,  # The H200 has the H100 SXM's compute and more, faster memory.
    'b200': {'bfloat16': 2250e12, 'float16': 2250e12, 'float32': 1100e12},
}
# (version, variant) of a 'TPU v5 lite' / 'TPU v5e' / 'TPU v5p' / 'TPU v5' kind string.
_TPU_FAMILIES = {('4', ''): 'tpu_v4', ('5', 'e'): 'tpu_v5e', ('5', 'p'): 'tpu_v5p',
                 ('5', ''): 'tpu_v5p', ('6', 'e'): 'tpu_v6e'}


def device_family(device_kind: str) -> str | None:
  """The PEAK_FLOPS key of a `jax.Device.device_kind` string; None for unknown kinds (CPU)."""
  kind = device_kind.lower()
  tpu = re.search(r'tpu\s*v(\d+)\s*(lite|e|p)?\b', kind)
  if tpu:
    version, variant = tpu.groups()
    return _TPU_FAMILIES.get((version, 'e' if variant == 'lite' else variant or ''))
  if re.search(r'\ba100\b', kind):
    return 'a100'
  if re.search(r'\bh100\b', kind):
    if 'pcie' in kind:
      return 'h100_pcie'
    return None if 'nvl' in kind else 'h100_sxm'  # H100 NVL: a different peak, not listed.
  if re.search(r'\bh200\b', kind):
    return 'h200'
  if re.search(r'\bb200\b', kind):
    return 'b200'
  return None


def peak_flops_per_second(device_kind: str, dtype) -> float | None:
  """Dense peak FLOP/s of one device computing in `dtype`; None where it is not known.

  float32 counts against the TF32 peak on A100/H100/H200 and the bfloat16 peak on TPU, the
  precision JAX's default lets XLA use for float32 matmuls.
  """
  family = device_family(device_kind)
  return PEAK_FLOPS[family].get(jnp.dtype(dtype).name) if family else None


def devices_peak_flops_per_second(devices, dtype) -> float | None:
  """Summed peak of `devices` (one kind, as in a mesh) computing in `dtype`; None if unknown."""
  peak = peak_flops_per_second(devices[0].device_kind, dtype)
  return peak * len(devices) if peak else None


def model_flops_per_step(*, d_model: int, d_ff: int, num_encoder_layers: int,
                         num_decoder_layers: int, vocab_size: int, source_tokens: int,
                         target_tokens: int, source_length: int, target_length: int) -> float:
  """Analytic FLOPs of one training update (forward + backward) of the encoder-decoder.

  6 x (matmul parameters touched per token) x tokens, plus attention's score/value matmuls:

    per source token:  L_enc (4 d^2 + 2 d d_ff)       encoder Q, K, V, O and FFN
                       + L_dec 2 d^2                   decoder cross-attention K, V
    per target token:  L_dec (6 d^2 + 2 d d_ff)        self Q, K, V, O, cross Q, O, FFN
                       + d V                           output projection (tied or not)
    attention:         3 x 4 d x (L_enc N_src L_src + L_dec N_tgt (L_tgt + L_src))

  N_src, N_tgt are the tokens (padding included: the step does that work) and L_src, L_tgt
  the padded lengths, so 2 x 2 L_q L_k d forward per layer and sequence for QK^T and AV, the
  full square for causal self-attention too, times 3 for forward + backward. The embedding
  lookup, biases, norms, softmax, dropout and the optimiser are left out; the head count does
  not change the count.
  """
  d, layers_e, layers_d = d_model, num_encoder_layers, num_decoder_layers
  per_source_token = layers_e * (4 * d * d + 2 * d * d_ff) + layers_d * 2 * d * d
  per_target_token = layers_d * (6 * d * d + 2 * d * d_ff) + d * vocab_size
  dense = 6 * (per_source_token * source_tokens + per_target_token * target_tokens)
  attention = 3 * 4 * d * (layers_e * source_tokens * source_length
                           + layers_d * target_tokens * (target_length + source_length))
  return float(dense + attention)


def decoder_only_flops_per_step(*, d_model: int, d_ff: int, num_layers: int, vocab_size: int,
                                rows: int, source_length: int, target_length: int) -> float:
  """Analytic FLOPs of one training update of the decoder-only model (Transformer-D).

  Every position of the joined sequence (length L = L_src + L_tgt, padding included) passes
  through the layers' Q, K, V, O and FFN; only the target part reaches the output layer; each
  layer's attention is the full L x L square:

    6 x (rows L num_layers (4 d^2 + 2 d d_ff) + rows L_tgt d V) + 3 x 4 d num_layers rows L^2
  """
  d, length = d_model, source_length + target_length
  dense = 6 * (rows * length * num_layers * (4 * d * d + 2 * d * d_ff)
               + rows * target_length * d * vocab_size)
  attention = 3 * 4 * d * num_layers * rows * length * length
  return float(dense + attention)


def train_step_flops(model_config, rows: int, source_length: int, target_length: int) -> float:
  """Analytic FLOPs of one training update of a model config (TransformerConfig), any member.

  The paper's model gives `model_flops_per_step` (the decoder-only one
  `decoder_only_flops_per_step`); the family changes these terms, layer by layer:
    mixture of experts: the feed-forward term is the P experts a token is routed to,
      P x 2 d d_ff, plus the router's d X (not the dense 2 d d_ff; capacity slack, empty
      slots and the one-hot dispatch are not model FLOPs);
    'local' layers: a query's scores and values cover min(2w + 1, n) keys (w =
      local_half_width), not the n of full attention (the masked half counts in causal
      layers, as for full attention);
    'compressed' layers: ceil(n / Z) compressed keys plus the Z of its own block, and the
      key and value convolutions, 2 x 2 d D per token (Z the stride, D the head size).
      Packed rows compute more (every block slot of the row, up to 2n / (Z + 1), and the three
      raw blocks around a query, to find each segment's own): that is the implementation's
      cost of packing, not the model's, so it is not counted.
  Cross-attention stays full.
  """
  cfg = model_config
  if cfg.kind == 'encoder_only':
    return encoder_only_flops(cfg, rows, source_length, target_length)
  if cfg.kind == 'decoder_only':
    return float(3 * _stack_flops(cfg, cfg.num_decoder_layers, rows,
                                  source_length + target_length)
                 + 6 * rows * target_length * cfg.d_model * cfg.vocab_size)
  d = cfg.d_model
  encoder = _stack_flops(cfg, cfg.num_encoder_layers, rows, source_length)
  decoder = _stack_flops(cfg, cfg.num_decoder_layers, rows, target_length)
  source_tokens, target_tokens = rows * source_length, rows * target_length
  cross = cfg.num_decoder_layers * (2 * (2 * d * d) * (source_tokens + target_tokens)
                                    + 4 * d * target_tokens * source_length)
  output = 2 * target_tokens * d * cfg.vocab_size
  return float(3 * (encoder + decoder + cross + output))


MLM_RATE = 0.15  # The default data.mlm_rate: the chosen positions' share of a masked-LM row.


def encoder_only_flops(cfg, rows: int, source_length: int, target_length: int) -> float:
  """An encoder-only update: the stack over its text (the targets in masked-LM pre-training,
  the inputs under a task head), then the head: the masked-LM transform and output layer at
  ceil(MLM_RATE x L) positions a row (another data.mlm_rate changes this small term only; with
  ELECTRA's generator stack before it and the replaced-token head at every token after), or
  the pooler and classifier once a row."""
  d = cfg.d_model
  if cfg.head == 'mlm':
    chosen = rows * math.ceil(MLM_RATE * target_length)
    return float(3 * (_stack_flops(cfg, cfg.num_encoder_layers, rows, target_length)
                      + 2 * chosen * (d * d + d * cfg.vocab_size)))
  if cfg.head == 'electra':  # Both stacks over the text; each token's replaced logit.
    chosen, tokens = rows * math.ceil(MLM_RATE * target_length), rows * target_length
    return float(3 * (_stack_flops(cfg, cfg.num_encoder_layers, rows, target_length)
                      + _stack_flops(dataclasses.replace(cfg, moe_experts=0),  # Dense layers.
                                     cfg.generator_layers, rows, target_length)
                      + 2 * chosen * (d * d + d * cfg.vocab_size) + 2 * tokens * (d * d + d)))
  return float(3 * (_stack_flops(cfg, cfg.num_encoder_layers, rows, source_length)
                    + 2 * rows * (d * d + d * max(cfg.num_labels, 1))))


def _stack_flops(cfg, num_layers: int, rows: int, length: int) -> float:
  """Forward FLOPs of a stack of self-attention + feed-forward layers over rows of `length`."""
  d, tokens = cfg.d_model, rows * length
  kinds = [kind.strip() for kind in cfg.attention_pattern.split(',')]
  moe_layers = _moe_layers(cfg, num_layers)
  total = 0
  for layer in range(num_layers):
    kind = kinds[layer % len(kinds)]
    if kind == 'local':
      keys = min(2 * cfg.local_half_width + 1, length)
    elif kind == 'compressed':
      keys = -(-length // cfg.compression_stride) + cfg.compression_stride
      total += 2 * 2 * d * (d // cfg.num_heads) * tokens  # The key and value convolutions.
    else:
      keys = length
    if layer in moe_layers:
      ffn = cfg.moe_top_k * 2 * d * cfg.d_ff + d * cfg.moe_experts
    else:
      ffn = 2 * d * cfg.d_ff
    total += 2 * (4 * d * d + ffn) * tokens + 4 * d * tokens * keys
  return total


def _moe_layers(cfg, num_layers: int) -> tuple[int, ...]:
  """The MoE layers of a stack (moe.layer_indices, read here without importing the model)."""
  if not cfg.moe_experts:
    return ()
  if cfg.moe_layers == 'all':
    return tuple(range(num_layers))
  if cfg.moe_layers == 'every_other':
    return tuple(range(1, num_layers, 2))
  return tuple(int(part) for part in cfg.moe_layers.split(','))


def mfu(model_flops: float, seconds: float, peak: float) -> float:
  """Model FLOPs utilisation: model_flops / seconds / peak (peak of all devices doing the work)."""
  return model_flops / seconds / peak
