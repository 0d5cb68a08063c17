"""Multi30k speedrun, sweep 1: how the learning rate ends at a budget (short runs).

  python launch/sweep.py configs/sweeps/multi30k_schedule.py -- \
    python -m t2t_jax.main --config=configs/multi30k.py:speedrun --workdir=/tmp/m30_schedule \
    --config.train.num_steps=1200 --config.train.eval_every=1200 --config.model.dropout=0.3 \
    --config.model.positions=sinusoidal
  python launch/sweep.py --summarize /tmp/m30_schedule --sort=bleu

The paper's rsqrt schedule as it is, with a linear cooldown over the last third, at twice the
rate with that cooldown, and linear or cosine decay from the same peak; all with the
reference model and its 500-step warmup. Points are compared on valid at equal updates. It ran
before the speedrun took rotary positions and dropout 0.2, so the command sets the reference's.
"""


def get_sweep():
  return {'zip': {'opt.schedule': ['rsqrt', 'rsqrt', 'rsqrt', 'linear', 'cosine'],
                  'opt.cooldown_steps': [0, 400, 400, 0, 0],
                  'opt.lr_scale': [1.0, 1.0, 2.0, 1.0, 1.0]}}
