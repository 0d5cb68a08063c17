"""t2t_jax: the Transformer of "Attention Is All You Need", trained the tensor2tensor way on JAX.

Shapes in names (`q_BQHD`, `logits_BLV`), one letter per axis, the same in every module:
  B batch rows          L (target) length      S source length        E d_model
  Q query positions     K key positions        H heads                D head dim
  F feed-forward width  V vocabulary           T tokens, flattened    U loss chunks
  G query blocks (local attention)             M compressed key blocks
  Z tokens per compressed block (the stride)   R relative distances (2k + 1)
  X experts             P experts per token    A expert capacity (slots per expert and row)
  W beam width          N = B * W beam rows    C candidates per search step (2W)
  J rotary pairs of a head (D / 2)
"""

PAD_ID = 0
EOS_ID = 1
# Config keys that were renamed: old dotted key -> new one. A flag with the old key is refused
# naming the new one; a config saved with the old key (config.json, checkpoints) still loads.
RENAMED_KEYS = {'model.local_window': 'model.local_half_width'}
# Config keys added later: dotted key -> the value that does what the code did before it. A
# config saved without the key (config.json, checkpoints) loads with that value.
ADDED_KEYS = {'eval.length_penalty': 'gnmt', 'train.profile_steps': [],
              'data.mlm_rate': 0.15, 'data.whole_word_masking': False, 'data.labels': [],
              'model.head': 'mlm', 'model.num_labels': 0, 'model.type_vocab_size': 0,
              'model.pooling': 'cls', 'opt.decay_vectors': True, 'opt.layer_lr_decay': 1.0,
              'eval.best_metric': 'accuracy', 'data.holdout': 0.0, 'data.train_limit': 0,
              'model.next_sentence': False, 'data.extra_src': '', 'data.extra_tgt': '',
              'data.mix_weights': '', 'data.extra_tag': '', 'opt.loss_impl': 'xla',
              'mesh.collective_combine_bytes': 0, 'opt.frozen': '', 'model.generator_layers': 1,
              'opt.replaced_weight': 50.0, 'mesh.shard_update': False}


# The errors most modules raise, defined in errors.py, importable from the package too.
from t2t_jax.errors import CheckpointError, ConfigError, NonFiniteLoss  # pylint: disable=wrong-import-position

RESOLVED_KEY = 'resolved'  # config.json's values resolved for the run's devices (resolve.py).


def as_asked(saved: dict) -> dict:
  """A saved config.json as the config it asked for: renamed keys under their new names,
  without the values it resolved to on its devices."""
  return with_current_keys({key: value for key, value in saved.items() if key != RESOLVED_KEY})


def with_current_keys(tree: dict) -> dict:
  """A saved config (nested dicts, as config.json holds it) with renamed keys under their new
  names and added keys at their old behaviour, so configs written before still load and
  compare."""
  tree = {key: with_current_keys(value) if isinstance(value, dict) else value
          for key, value in tree.items()}
  for old, new in RENAMED_KEYS.items():
    (section, old_name), new_name = old.split('.'), new.split('.')[1]
    part = tree.get(section)
    if isinstance(part, dict) and old_name in part and new_name not in part:
      part[new_name] = part.pop(old_name)
  for key, value in ADDED_KEYS.items():
    section, name = key.split('.')
    part = tree.get(section)
    if isinstance(part, dict) and name not in part:
      part[name] = value
  return tree
