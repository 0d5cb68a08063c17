"""BERT-style encoders (Devlin et al. 2019): masked-LM pre-training on text files, then
fine-tuning for labels (docs/pretraining.md has the whole workflow).

  python -m t2t_jax.main --config=configs/bert.py:small --workdir=/tmp/bert_small
  python -m t2t_jax.main --config=configs/bert.py:small,finetune --workdir=/tmp/sst2 \\
      --config.ckpt.init_from=/tmp/bert_small/checkpoints/3500 \\
      --config.data.vocab_path=/tmp/bert_small/vocab.model

Variants, chosen after the file name (a comma then 'finetune' turns any into a fine-tuning run:
a classification head on labelled TSV files, SST-2's by default, AdamW without decay on
biases and norms, linear warmup and decay; a comma then 'electra' pre-trains it as ELECTRA's
discriminator, Clark et al. 2020, beside a generator a quarter as deep, and is fine-tuned the
same way):
  base   L=12, d_model 768, 12 heads, FFN 3072, 30,522 pieces: BERT-Base (about 110M parameters)
  large  L=24, d_model 1024, 16 heads, FFN 4096: BERT-Large (about 340M)
  small  L=4, d_model 256, 4 heads, FFN 1024, 8,000 pieces: pre-trains on this machine's CPU
  tiny   L=2, d_model 32: seconds, for tests

Pre-training reads the English text in ../shared/data (relative to where you run): SST-2's and
AG News's training texts without their labels, and the English sides of Multi30k and the WMT
sample. Rows are packed with whole sentences, each [CLS] sentence EOS, up to data.max_len.
"""

import math

from configs import base

SIZES = {  # layers, d_model, heads, d_ff, vocabulary, longest row
    'base': (12, 768, 12, 3072, 30522, 512),
    'large': (24, 1024, 16, 4096, 30522, 512),
    'small': (4, 256, 4, 1024, 8000, 128),
    'tiny': (2, 32, 2, 64, 256, 32),
}
PRETRAINING_TEXT = ('sst2/train.tsv,agnews/train.tsv,multi30k/train.en,wmt-sample/train.en')


def peak_rate_scale(peak: float, d_model: int, warmup: int) -> float:
  """opt.lr_scale giving a 'linear' schedule whose peak (after `warmup`) is `peak`."""
  return peak * math.sqrt(d_model) * math.sqrt(warmup)


def get_config(variant: str = 'small'):
  size, _, mode = variant.partition(',')
  if size not in SIZES or mode not in ('', 'finetune', 'electra'):
    raise ValueError(f'configs/bert.py:{variant}: the variant must be one of {tuple(SIZES)}, '
                     "optionally followed by ',finetune' or ',electra'")
  layers, d_model, heads, d_ff, vocab, max_len = SIZES[size]
  config = base.get_config()
  config.name = f'bert_{size}' + (f'_{mode}' if mode else '')

  model = config.model
  model.kind = 'encoder_only'
  model.num_encoder_layers = layers
  model.d_model, model.num_heads, model.d_ff = d_model, heads, d_ff
  model.positions = 'learned'
  model.type_vocab_size = 2
  model.max_len = max_len
  model.norm = 'pre'  # Trains stably without a long warmup on small batches.
  model.dropout = model.attention_dropout = model.relu_dropout = 0.1
  model.tie_output = True

  data = config.data
  data.source = 'lm'
  data.data_dir = '../shared/data'
  data.train_text = PRETRAINING_TEXT
  data.eval_text = 'sst2/valid.tsv'
  data.vocab_size = vocab
  data.vocab_type = 'unigram'
  data.max_len = min(max_len, 128)
  data.batching = 'packed'
  data.batch_tokens = 8192 if size == 'small' else 128 * 512
  data.bad_lines = 'skip'  # The WMT sample has an empty line.

  opt = config.opt
  opt.label_smoothing = 0.0
  opt.schedule = 'linear'
  opt.weight_decay = 0.01
  opt.decay_vectors = False
  opt.b2 = 0.999
  opt.eps = 1e-6
  opt.grad_clip = 1.0
  # small: about an hour of a normal day's 2-core CPU (docs/results/pretraining.md); base and large:
  # BERT's 1M updates, of 65,536 tokens here (BERT's: 256 rows of 128 tokens for 90% of its
  # updates, of 512 for the rest).
  opt.warmup_steps = 200 if size == 'small' else 10_000
  opt.lr_scale = peak_rate_scale(1e-3 if size == 'small' else 1e-4, d_model, opt.warmup_steps)
  opt.loss_chunk_tokens = 0

  config.train.num_steps = 3500 if size == 'small' else 1_000_000
  config.train.log_every = 100
  config.train.eval_every = config.ckpt.every = 500 if size == 'small' else 10_000
  config.eval.bleu_sentences = 0

  if size == 'tiny':
    data.vocab_size, data.batch_tokens = 256, 512
    opt.warmup_steps, opt.lr_scale = 10, peak_rate_scale(1e-3, d_model, 10)
    config.train.num_steps, config.train.log_every = 40, 10
    config.train.eval_every = config.ckpt.every = 20
    model.dropout = model.attention_dropout = model.relu_dropout = 0.0

  if mode == 'finetune':
    _finetune(config, size)
  if mode == 'electra':
    model.head = 'electra'
    model.generator_layers = max(1, layers // 4)
  return config


def _finetune(config, size: str) -> None:
  """Classification on labelled TSV files from a pre-trained run (ckpt.init_from) or, with no
  init_from, from scratch; the label set is read from the training file."""
  data, opt, model = config.data, config.opt, config.model
  model.head = 'classification'
  data.source = 'labelled'
  data.train_tsv, data.eval_tsv = 'sst2/train.tsv', 'sst2/valid.tsv'
  data.batching = 'buckets'
  data.batch_tokens = 32 * 64 if size != 'tiny' else 256
  data.min_bucket = 8
  # About two passes over SST-2's 60,614 examples (rows of about 128 short phrases).
  steps = {'tiny': 30, 'small': 1000}.get(size, 6000)
  config.train.num_steps = steps
  opt.warmup_steps = max(1, steps // 10)
  opt.lr_scale = peak_rate_scale({'tiny': 1e-3, 'small': 3e-4}.get(size, 5e-5), model.d_model,
                                 opt.warmup_steps)
  config.train.log_every = max(1, steps // 20)
  config.train.eval_every = config.ckpt.every = max(1, steps // 5)
  config.eval.best_metric = 'accuracy'
