"""A search on the Multi30k recipe's model at a reduced budget (docs/scaling.md, "Searching"):
peak learning-rate scale, warmup and dropout, greedy BLEU on the first 200 valid sentences up,
TPE with the median pruner. Trials stop at the budget the base command gives:

  python launch/search.py configs/searches/multi30k_lr.py -- python -m t2t_jax.main \
      --config=configs/multi30k.py:rotary --config.train.num_steps=600 \
      --config.train.eval_every=150 --config.ckpt.every=150 --config.eval.bleu_sentences=200 \
      --config.data.cache_dir=/tmp/m30k_search_cache --workdir=/tmp/m30k_search
"""


def get_search():
  return {
      'params': {'opt.lr_scale': ('log_uniform', 0.25, 4.0),
                 'opt.warmup_steps': ('int', 100, 600, 50),
                 'model.dropout': ('choice', [0.1, 0.2, 0.3])},
      'metric': 'bleu',
      'trials': 8,
      'sampler': 'tpe',
      # Not before the second evaluation (step 300 of 600), and not before two trials ended.
      'pruner': ('median', {'n_startup_trials': 2, 'n_warmup_steps': 300}),
  }
