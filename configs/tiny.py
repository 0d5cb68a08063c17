"""A model small enough for unit tests and CI: seconds to compile and train."""

from configs import base


def get_config(variant: str = ''):
  """variant: '' (dense) or 'moe' (4 experts, top-2, in every layer)."""
  if variant not in ('', 'moe'):
    raise ValueError(f"configs/tiny.py: variant must be '' or 'moe', got {variant!r}")
  config = base.get_config()
  config.name = f'tiny_{variant}' if variant else 'tiny'
  config.data.task = 'copy'
  config.data.num_symbols = 8
  config.data.min_length = 1
  config.data.max_length = 8
  config.data.num_train = 2048
  config.data.num_eval = 64
  config.data.batch_tokens = 256
  config.data.min_bucket = 16
  config.model.d_model = 32
  config.model.d_ff = 64
  config.model.num_heads = 2
  config.model.num_encoder_layers = 1
  config.model.num_decoder_layers = 1
  config.model.max_len = 32
  config.opt.lr_scale = 2.0
  config.opt.warmup_steps = 20
  config.train.num_steps = 20
  config.train.log_every = 5
  config.train.eval_every = 10
  config.eval.bleu_sentences = 16
  config.eval.beam_size = 1
  config.eval.max_extra_len = 4
  config.eval.examples_to_print = 1
  config.ckpt.every = 10
  if variant == 'moe':
    config.model.moe_experts = 4
    config.model.moe_top_k = 2
    config.model.moe_layers = 'all'  # Both stacks have one layer: 'every_other' would skip it.
  return config
