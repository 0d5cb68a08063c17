"""WMT14 English->German, the paper's base and big models (--config=configs/wmt14_ende.py:big).

Data from TFDS: wmt14_translate/de-en for training, newstest2013 (its validation split) for
evaluation, newstest2014 (test) for the final figures. For WMT17's larger training set with
the same eval and test sets: --config.data.tfds_name=wmt17_translate/de-en
--config.data.tfds_eval_name=wmt14_translate/de-en.
"""

from configs import base


def get_config(variant='base'):
  """variant: 'base' or 'big' of Table 3 of the paper: 63.0M and 214.2M parameters with the
  shared 37,000-token vocabulary here (the paper's table: 65M and 213M)."""
  if variant not in ('base', 'big'):
    raise ValueError(f"configs/wmt14_ende.py: variant must be 'base' or 'big', got {variant!r}")
  config = base.get_config()
  config.name = f'wmt14_ende_{variant}'
  config.data.source = 'tfds'
  config.data.tfds_name = 'wmt14_translate/de-en'
  config.data.tfds_train_split = 'train'
  config.data.tfds_eval_split = 'validation'
  config.data.tfds_test_split = 'test'
  config.data.source_lang = 'en'
  config.data.target_lang = 'de'
  config.data.bad_lines = 'skip'  # Web-crawled training data holds some empty lines.
  config.data.vocab_size = 37_000
  config.data.vocab_type = 'bpe'
  config.data.vocab_sample_chars = 10_000_000
  config.data.max_len = 256
  config.data.batch_tokens = 25_000
  config.opt.warmup_steps = 4000
  config.model.dtype = 'auto'  # bfloat16 activations on GPU/TPU, float32 on CPU.
  # One chunk for the paper's 25k-token batch: the output layer's [V, E] gradient is read and
  # written once per chunk, which costs more bytes than a few hundred tokens' logits do
  # (docs/scaling.md). On a CPU (float32) a smaller chunk holds less memory.
  config.opt.loss_chunk_tokens = 32_768
  config.train.num_steps = 100_000 if variant == 'base' else 300_000
  config.train.eval_every = 5000
  config.ckpt.every = 5000
  config.eval.beam_size = 4
  config.eval.alpha = 0.6
  config.eval.max_extra_len = 50
  config.eval.bleu_sentences = -1  # All of newstest2013.
  config.eval.bleu_every = 10_000
  config.eval.average_last = 5 if variant == 'base' else 20  # As the paper evaluated.
  config.ckpt.keep = config.eval.average_last
  if variant == 'big':
    config.model.d_model = 1024
    config.model.d_ff = 4096
    config.model.num_heads = 16
    config.model.dropout = 0.3
  return config
