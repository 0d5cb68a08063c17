"""Fine-tuning a pre-trained encoder for a label set: peak learning rate and layer-wise
learning-rate decay, Matthews correlation up (the figure that does not flatter a classifier
that favours the larger class), 12 trials, the median pruner after the first three.

  python launch/search.py configs/searches/bert_finetune.py -- python -m t2t_jax.main \
      --config=configs/bert.py:small,finetune --workdir=/tmp/bert_search \
      --config.ckpt.init_from=/tmp/bert/pre/checkpoints/3500 \
      --config.data.vocab_path=/tmp/bert/pre/vocab.model --config.data.train_limit=1000 \
      --config.train.num_steps=300

opt.lr_scale is the schedule's scale, peak x sqrt(d_model) x sqrt(warmup) (configs/bert.py's
peak_rate_scale): 0.003 to 0.09 spans peaks of about 3e-5 to 1e-3 for the small encoder
(d_model 256) and these runs' 30-step warmup.
"""


def get_search():
  return {
      'params': {'opt.lr_scale': ('log_uniform', 0.003, 0.09),
                 'opt.layer_lr_decay': ('uniform', 0.6, 1.0)},
      'metric': 'eval_mcc',
      'trials': 12,
      'pruner': ('median', {'n_startup_trials': 3}),
  }
