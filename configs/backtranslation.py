"""Back-translation on Multi30k (docs/backtranslation.md): a third of the training pairs kept as
parallel data, the German of the other two thirds as monolingual text. Every run is the
:speedrun recipe of configs/multi30k.py (tokenised lowercased files, 9,200 updates).

Variants, chosen after the file name:
  configs/backtranslation.py:reverse     de->en on the parallel third: the back-translator.
  configs/backtranslation.py:parallel    en->de on the parallel third alone (the lower bound).
  configs/backtranslation.py:mix         en->de on the parallel third and the synthetic pairs
                                         (synthetic.en: the back-translations, synthetic.de:
                                         the monolingual German they came from), each once.
  configs/backtranslation.py:mix_tagged  the same with '<BT>' before every synthetic source
                                         (Caswell et al. 2019).
  configs/backtranslation.py:all         en->de on all the real pairs (the upper bound).

The files are read from `config.data.data_dir` (default: multi30k_thirds, relative to the
directory you run from), which the guide's first step fills: parallel.{en,de}, mono.de,
train.{en,de} and valid.{en,de} (links to Multi30k's), then synthetic.{en,de}.
"""

from configs import multi30k

DATA_DIR = 'multi30k_thirds'
VARIANTS = ('reverse', 'parallel', 'mix', 'mix_tagged', 'all')
TAG = '<BT>'  # The synthetic sources' marker in :mix_tagged.


def get_config(variant: str = 'parallel'):
  if variant not in VARIANTS:
    raise ValueError(f'configs/backtranslation.py:{variant}: the variant must be one of '
                     f'{list(VARIANTS)}')
  config = multi30k.get_config('tok_speedrun')
  config.name = f'backtranslation_{variant}'
  data = config.data
  data.data_dir = DATA_DIR
  source, target = ('de', 'en') if variant == 'reverse' else ('en', 'de')
  train = 'train' if variant == 'all' else 'parallel'
  data.train_src, data.train_tgt = f'{train}.{source}', f'{train}.{target}'
  data.eval_src, data.eval_tgt = f'valid.{source}', f'valid.{target}'
  if variant.startswith('mix'):
    data.extra_src, data.extra_tgt = 'synthetic.en', 'synthetic.de'
    data.mix_weights = '1,1'  # Upsample the real pairs with e.g. --config.data.mix_weights=2,1.
  if variant == 'mix_tagged':
    data.extra_tag = TAG
  return config
