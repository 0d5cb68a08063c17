"""A search on the tiny config (tests and a quick example): learning-rate scale and warmup,
eval loss down, 8 trials, the median pruner from the second trial on.

  python launch/search.py configs/searches/tiny_lr.py -- python -m t2t_jax.main \
      --config=configs/tiny.py --config.train.num_steps=40 --config.train.eval_every=5 \
      --config.ckpt.every=5 --workdir=/tmp/tiny_search
"""


def get_search():
  return {
      'params': {'opt.lr_scale': ('log_uniform', 0.05, 8.0),
                 'opt.warmup_steps': ('int', 5, 40)},
      'metric': 'eval_loss',
      'trials': 8,
      'sampler': 'random',
      'pruner': ('median', {'n_startup_trials': 2}),
  }
