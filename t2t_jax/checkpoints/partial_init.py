"""Starting a run from saved parameters (config.ckpt.init_from): the whole model, or for an
encoder-only run whose head differs from the saved one's (fine-tuning a pre-trained encoder)
the arrays both models have, the rest initialised fresh, and one log line saying which.

Refused in one line: a saved model of another kind, or trained on another vocabulary (its
config's vocabulary size, or its vocabulary file's bytes, differ from this run's).
"""

import json
import os

from absl import logging
import jax
import numpy as np

from t2t_jax import CheckpointError
from t2t_jax import ConfigError
from t2t_jax import as_asked
from t2t_jax.checkpoints import saved_params


def saved_config(path: str) -> dict:
  """The config (as asked) a checkpoint directory was saved with: a training step's or a
  params-only checkpoint's."""
  try:
    text = saved_params.read_json_item(path, saved_params.CONFIG)['config']
  except Exception as e:  # pylint: disable=broad-exception-caught
    raise CheckpointError(f'{path}: cannot read the config it was saved with '
                          f'({saved_params.describe_error(e)}): is it a t2t_jax checkpoint?'
                          ) from None
  return as_asked(json.loads(text))


def _check_compatible(path: str, saved: dict, config, vocab_file: str | None) -> None:
  kind, saved_kind = config.model.kind, saved['model'].get('kind', 'encoder_decoder')
  if saved_kind != kind:
    raise ConfigError(f'config.ckpt.init_from={path} holds a {saved_kind} model, and this run '
                      f'is {kind}: start from a checkpoint of a {kind} run')
  saved_vocab, vocab = saved['data'].get('vocab_size'), config.data.vocab_size
  if saved_vocab != vocab:
    raise ConfigError(f'config.ckpt.init_from={path} was trained with a vocabulary of '
                      f'{saved_vocab} pieces, this run has {vocab}: set config.data.vocab_path '
                      "to the pre-training run's vocabulary and config.data.vocab_size to match")
  saved_file = _saved_vocab_file(path, saved)
  if vocab_file and saved_file and _read(saved_file) not in (None, _read(vocab_file)):
    raise ConfigError(f'config.ckpt.init_from={path} was trained with the vocabulary '
                      f'{saved_file}, whose pieces differ from this run\'s {vocab_file}: set '
                      "config.data.vocab_path to the pre-training run's vocabulary")


def _saved_vocab_file(path: str, saved: dict) -> str | None:
  """The vocabulary file of the run that saved `path`, where it can be found: its
  data.vocab_path, else vocab.model in its cache_dir or its workdir (the folder above a
  params-only checkpoint, or two above a training step)."""
  data = saved['data']
  if data.get('vocab_path'):
    return data['vocab_path']
  folders = [data.get('cache_dir') or '', os.path.dirname(os.path.abspath(path)),
             os.path.dirname(os.path.dirname(os.path.abspath(path)))]
  for folder in filter(None, folders):
    if os.path.exists(os.path.join(folder, 'vocab.model')):
      return os.path.join(folder, 'vocab.model')
  return None


def _read(path: str) -> bytes | None:
  try:
    with open(path, 'rb') as f:
      return f.read()
  except OSError:
    return None


def merge(fresh: dict, saved: dict) -> tuple[dict, list[str], list[str]]:
  """(params, taken, fresh names): `fresh`'s tree with every array `saved` has at the same
  path and shape; the top-level names taken whole from it and those kept (wholly or partly)
  fresh."""
  saved_flat = saved_params.array_shapes(saved)
  saved_leaves = {saved_params.path_name(p): leaf
                  for p, leaf in jax.tree_util.tree_leaves_with_path(saved)}
  taken, kept = set(), set()

  def pick(path, leaf):
    name = saved_params.path_name(path)
    top = name.split('/')[0]
    if name in saved_flat and saved_flat[name][0] == tuple(leaf.shape):
      taken.add(top)
      return np.asarray(saved_leaves[name]).astype(leaf.dtype)
    kept.add(top)
    return leaf
  merged = jax.tree_util.tree_map_with_path(pick, fresh)
  return merged, sorted(taken - kept), sorted(kept)


def init_params(path: str, config, fresh_params, abstract_params, vocab_file: str | None):
  """The params a fresh run starts from: `path`'s whole (the same model) or, for an
  encoder-only model whose arrays differ, the arrays both have over `fresh_params`."""
  saved = saved_config(path)
  _check_compatible(path, saved, config, vocab_file)
  if config.model.kind != 'encoder_only' or saved['model'].get('head') == config.model.head:
    params = saved_params.load_params(path, abstract_params)
    logging.info('Initialised from %s: loaded the whole model (%d arrays); the optimiser '
                 'state, step and schedule start fresh', path, len(jax.tree.leaves(params)))
    return params
  numpy_saved = saved_params.load_params(path)
  merged, taken, kept = merge(jax.device_get(fresh_params), numpy_saved)
  if not taken:
    raise CheckpointError(f'config.ckpt.init_from={path} has no array of this model\'s '
                          'shape: its encoder is of another size. Use the pre-training run\'s '
                          'model config.')
  dropped = sorted(set(name.split('/')[0] for name in saved_params.array_shapes(numpy_saved))
                   - set(taken) - set(kept))
  logging.info('Initialised from %s: loaded %s; initialised fresh %s%s', path,
               ', '.join(taken), ', '.join(kept) or 'nothing',
               f'; not used {", ".join(dropped)}' if dropped else '')
  shardings = jax.tree.map(lambda s: s.sharding, abstract_params)
  return jax.tree.map(lambda x, s: jax.device_put(x, s), merged, shardings)
