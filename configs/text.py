"""Any pair of parallel text files: pass --config.data.train_src=... and friends."""

from configs import base


def get_config():
  config = base.get_config()
  config.name = 'text'
  config.data.source = 'text'
  config.data.vocab_size = 8000
  config.data.batch_tokens = 4096
  config.model.d_model = 256
  config.model.d_ff = 1024
  config.model.num_heads = 4
  config.model.num_encoder_layers = 3
  config.model.num_decoder_layers = 3
  config.opt.lr_scale = 2.0
  config.opt.warmup_steps = 2000
  config.train.num_steps = 20_000
  config.eval.bleu_sentences = -1
  return config
