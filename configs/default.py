"""The embedded default: a small Transformer learns to reverse sequences in a few CPU minutes."""

from configs import base


def get_config():
  config = base.get_config()
  config.name = 'default'
  config.data.task = 'reverse'
  config.data.num_symbols = 16
  config.data.min_length = 1
  config.data.max_length = 20
  config.data.num_train = 50_000
  config.data.num_eval = 256
  config.data.batch_tokens = 1024
  config.data.min_bucket = 8
  config.data.bucket_scale = 1.5
  config.model.d_model = 128
  config.model.d_ff = 256
  config.model.num_heads = 4
  config.model.num_encoder_layers = 2
  config.model.num_decoder_layers = 2
  config.model.dropout = 0.0  # Fresh random examples cannot be memorised.
  config.model.attention_dropout = 0.0
  config.model.relu_dropout = 0.0
  config.model.max_len = 64
  config.opt.loss_chunk_tokens = 0  # An 18-entry vocabulary: whole logits are small and fast.
  config.opt.lr_scale = 2.0
  config.opt.warmup_steps = 400
  # Linear decay to 0 over the last 1200 steps: the final weights settle, so the final figures
  # do not swing with the CPU or XLA build (docs/training.md, "The default run").
  config.opt.cooldown_steps = 1200
  config.train.num_steps = 3400
  config.train.log_every = 250
  config.train.eval_every = 1700
  config.eval.bleu_sentences = -1
  config.eval.beam_size = 1
  config.eval.max_extra_len = 5
  config.ckpt.every = 1000
  return config
