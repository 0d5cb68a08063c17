"""The big model: (dropout, label smoothing) pairs zipped, each at two learning-rate scales."""


def get_sweep():
  return {
      'product': {'opt.lr_scale': [1.0, 2.0]},
      'zip': {'model.dropout': [0.1, 0.3], 'opt.label_smoothing': [0.1, 0.2]},
  }
