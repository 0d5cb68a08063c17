"""What the programs reading a trained run (translate, evaluate, the exports) take from its
workdir besides checkpoints: the config it asked for, and its vocabulary."""

import json
import os

import ml_collections

from t2t_jax import as_asked
from t2t_jax import CheckpointError
from t2t_jax import workdir_layout
from t2t_jax.data import pipeline
from t2t_jax.data import tokenizer


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The config training wrote to <workdir>/config.json, as asked (its values resolved for
  the training devices are for resuming; translation resolves for its own)."""
  path = os.path.join(workdir, workdir_layout.CONFIG_JSON)
  try:
    with open(path) as f:
      return ml_collections.ConfigDict(as_asked(json.load(f)))
  except OSError as e:
    raise CheckpointError(f'cannot read {path} ({e.strerror}): --workdir must be the '
                          'directory of a training run') from None


def load_vocabulary(config, workdir: str) -> tokenizer.Vocabulary:
  """The run's vocabulary: its SentencePiece model, or the synthetic task's symbols."""
  if config.data.source == 'synthetic':
    return pipeline.synthetic_vocabulary(config.data)
  path = pipeline.vocab_path(config, workdir)
  if not os.path.exists(path):
    raise CheckpointError(f'the vocabulary {path} of this run is missing: restore it, or set '
                          '--workdir to the run that has it')
  return tokenizer.SentencePieceVocabulary(path)
