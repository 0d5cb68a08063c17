"""A 2 x 2 grid on the tiny config: learning-rate scale by warmup (tests and a quick example)."""


def get_sweep():
  return {'product': {'opt.lr_scale': [1.0, 2.0], 'opt.warmup_steps': [10, 20]}}
