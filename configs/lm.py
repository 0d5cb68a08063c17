"""Language modelling on a text file with the decoder-only Transformer (Transformer-D).

  python -m t2t_jax.main --config=configs/lm.py --workdir=/tmp/lm
  python -m t2t_jax.main --config=configs/lm.py --workdir=/tmp/lm \
      --config.data.data_dir=/path/to/texts --config.data.train_text=train.txt \
      --config.data.eval_text=valid.txt

Each line of the file is one sequence (lines longer than data.max_len tokens, EOS included,
are dropped with a logged count); the loss is on every token. By default the German side of
Multi30k (../shared/data/multi30k/train.de and valid.de, relative to the directory you run
from), the size and recipe of configs/multi30k.py's model. Evaluation reports the per-token
loss and perplexity (exp of the per-token negative log-likelihood: with no label smoothing,
as here, exp(eval_loss)); there is no BLEU.

Variants, chosen after the file name:
  configs/lm.py       6 layers, d_model 128: a few CPU minutes per 1,000 steps.
  configs/lm.py:tiny  2 layers, d_model 32: seconds, for tests and smoke runs (point the
                      files at small text and lower data.vocab_size to what it can hold).
"""

from configs import base

VARIANTS = ('base', 'tiny')


def get_config(variant: str = 'base'):
  if variant not in VARIANTS:
    raise ValueError(f'configs/lm.py:{variant}: the variant must be one of {VARIANTS}')
  config = base.get_config()
  config.name = 'lm' if variant == 'base' else f'lm_{variant}'

  data = config.data
  data.source = 'lm'
  data.data_dir = '../shared/data/multi30k'
  data.train_text, data.eval_text = 'train.de', 'valid.de'
  data.vocab_size = 8000
  data.vocab_type = 'bpe'
  data.max_len = 64
  data.batching = 'packed'  # Rows of 64 tokens hold about four sentences.
  data.batch_tokens = 2048

  model = config.model
  model.kind = 'decoder_only'  # A language model has no source: one causal stack.
  model.d_model = 128
  model.d_ff = 256
  model.num_heads = 4
  model.num_decoder_layers = 6
  model.dropout = 0.3
  model.attention_dropout = 0.0
  model.relu_dropout = 0.0
  model.max_len = 64
  model.norm = 'pre'

  # No smoothing: the training loss is then the per-token cross-entropy that perplexity
  # exponentiates, so train and eval losses compare directly with published LM figures.
  config.opt.label_smoothing = 0.0
  config.opt.warmup_steps = 500

  config.train.num_steps = 4000
  config.train.log_every = 100
  config.train.eval_every = 500
  config.eval.bleu_sentences = 0  # Nothing to translate; config_check refuses anything else.
  config.ckpt.every = 500

  if variant == 'tiny':
    data.vocab_size = 256
    data.max_len = 32
    data.batch_tokens = 256
    model.d_model = 32
    model.d_ff = 64
    model.num_heads = 2
    model.num_decoder_layers = 2
    model.dropout = 0.0
    model.max_len = 32
    config.opt.lr_scale = 2.0
    config.opt.warmup_steps = 20
    config.train.num_steps = 20
    config.train.log_every = 5
    config.train.eval_every = 10
    config.ckpt.every = 10
  return config
