"""Multi30k speedrun, sweep 2: vocabulary, peak rate and batch size around sweep 1's winner.

  python launch/sweep.py configs/sweeps/multi30k_budget.py -- \
    python -m t2t_jax.main --config=configs/multi30k.py:speedrun --workdir=/tmp/m30_budget \
    --config.opt.lr_scale=2.0 --config.opt.cooldown_steps=400 --config.train.num_steps=1200 \
    --config.train.eval_every=1200 --config.model.dropout=0.3 --config.model.positions=sinusoidal
  python launch/sweep.py --summarize /tmp/m30_budget --sort=bleu

Each point changes one thing from sweep 1's best (rsqrt at twice the paper's rate, cooled down
over the last third): a 4k BPE vocabulary instead of 8k (a smaller output layer, so faster
steps), three times the paper's rate, or 4,096-token batches for 650 updates, about the
same training time as 1,200 updates of 2,048 tokens (cooled down over their last third too).
"""


def get_sweep():
  return {'zip': {'data.vocab_size': [4000, 8000, 8000],
                  'opt.lr_scale': [2.0, 3.0, 2.0],
                  'data.batch_tokens': [2048, 2048, 4096],
                  'train.num_steps': [1200, 1200, 650],
                  'opt.cooldown_steps': [400, 400, 217]}}
