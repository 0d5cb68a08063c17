"""A trained classifier (or regressor) loaded for prediction: its config, vocabulary, label
set and parameters; lines in, a label and the probability of every label out (the classify
command, t2t_jax/classify.py).

The parameters read by default are the best step's (<workdir>/best_params, kept by the
in-loop evaluation, training/classifier_eval.py), else the latest checkpoint's.
"""

import dataclasses
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from t2t_jax import ConfigError
from t2t_jax import sharding
from t2t_jax import workdir_layout
from t2t_jax.checkpoints import saved_params
from t2t_jax.checkpoints.run_files import load_config, load_vocabulary
from t2t_jax.data import classification
from t2t_jax.model.decoder_only import make_model
from t2t_jax.model.model_config import PRETRAINING_HEADS, TransformerConfig
from t2t_jax.training import build

ROW_MULTIPLE = 16  # Rows are padded to a multiple of this many tokens: few shapes to compile.


@dataclasses.dataclass
class Classifier:
  config: ml_collections.ConfigDict
  vocab: object
  names: list[str]  # The label set, in the order of the outputs; [] for a regressor.
  params: object
  apply: object  # jitted (params, tokens [B, L]) -> outputs [B, C]
  source: str  # Which parameters were read, for the log.

  @property
  def regression(self) -> bool:
    return self.config.model.head == 'regression'


def load(workdir: str, checkpoint: str | None = None) -> Classifier:
  """The run in `workdir` and its parameters: `checkpoint` (a step or a directory), else the
  best step's, else the latest step's."""
  config = load_config(workdir)
  if config.model.kind != 'encoder_only' or config.model.head in PRETRAINING_HEADS:
    raise ConfigError(f'{workdir} holds a {config.model.kind} model with head '
                      f"{config.model.head!r}, not a classifier or regressor: classify reads "
                      'a fine-tuning run (docs/pretraining.md)')
  vocab = load_vocabulary(config, workdir)
  mesh = sharding.make_mesh(config.mesh)
  axis_rules = sharding.rules(config.mesh)
  model_config = TransformerConfig.from_config(config.model, vocab.vocab_size,
                                               mesh.devices.flat[0].platform,
                                               deterministic=True)
  abstract = build.abstract_params(model_config, mesh, axis_rules)
  best = os.path.join(workdir, workdir_layout.BEST_PARAMS)
  if checkpoint is None and os.path.isdir(best):
    checkpoint = best
  params = saved_params.restore_params(workdir, abstract, checkpoint)
  model = make_model(model_config)

  @jax.jit
  def apply(params, tokens_BL):
    outputs_BC = model.apply({'params': params}, tokens_BL, method='head_outputs')
    return outputs_BC if config.model.head == 'regression' else jax.nn.softmax(outputs_BC)

  def run(params, tokens_BL):
    with sharding.mesh_context(mesh, axis_rules):
      return np.asarray(apply(params, jnp.asarray(tokens_BL)))
  return Classifier(config, vocab, list(config.data.labels), params, run,
                    checkpoint or 'the latest checkpoint')


def predict(classifier: Classifier, data: classification.LabelledText,
            batch_rows: int = 64) -> np.ndarray:
  """Outputs [N, C] in the order of `data`: each label's probability, or the value [N, 1]."""
  names = classifier.names or []
  encoded = classification.encode(classifier.vocab, data, names, classifier.regression,
                                  classifier.config.data.max_len)
  outputs = []
  for start in range(0, len(encoded.inputs), batch_rows):
    rows = encoded.inputs[start:start + batch_rows]
    width = -(-max(len(r) for r in rows) // ROW_MULTIPLE) * ROW_MULTIPLE
    tokens = np.zeros((batch_rows, width), np.int32)
    for i, row in enumerate(rows):
      tokens[i, :len(row)] = row
    outputs.append(classifier.apply(classifier.params, tokens)[:len(rows)])
  return np.concatenate(outputs) if outputs else np.zeros((0, max(1, len(names))), np.float32)
