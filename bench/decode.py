"""Decoding speed: sentences/s and target tokens/s of greedy and beam search, random weights.

  python bench/decode.py --config=configs/default.py
  python bench/decode.py --config=configs/wmt14_ende.py:base --num_sentences=16 --repeats=1

Source lengths follow real sentences (whitespace words of --sentences times
--subwords_per_word); token ids are random. Random weights rarely emit EOS, so most outputs
run to the length limit (source + config.eval.max_extra_len): the cost of the longest decode.
Prints one JSON line per beam size.
"""

import math
import os
import sys
import time

from absl import app
from absl import flags
import flax.linen as nn
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # pylint: disable=g-import-not-at-top

from t2t_jax import cli
from t2t_jax import EOS_ID
from t2t_jax import data
from t2t_jax import decode
from t2t_jax import sharding
from t2t_jax import translate
from t2t_jax.model import Transformer, TransformerConfig

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config to measure.')
_SENTENCES = flags.DEFINE_string('sentences', '../shared/data/wmt-sample/train.en',
                                 'Text whose line lengths set the source lengths.')
_NUM_SENTENCES = flags.DEFINE_integer('num_sentences', 128, 'Sentences decoded per repeat.')
_SUBWORDS_PER_WORD = flags.DEFINE_float('subwords_per_word', 1.3, 'Tokens per whitespace word.')
_BEAM_SIZES = flags.DEFINE_list('beam_sizes', ['1', '4'], 'Beam sizes to measure; 1 is greedy.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed passes over the sentences (median).')


def _source_lengths(path: str, count: int, per_word: float, longest: int) -> list[int]:
  with open(path, encoding='utf-8') as f:
    words = [len(line.split()) for line, _ in zip(f, range(count))]
  return [min(max(1, math.ceil(n * per_word)), longest - 1) + 1 for n in words]  # + EOS.


def _output_tokens(outputs) -> int:
  """Generated tokens, EOS included, of every output."""
  total = 0
  for ids in outputs:
    ids = list(ids)
    total += ids.index(EOS_ID) + 1 if EOS_ID in ids else len(ids)
  return total


def main(_):
  config = _CONFIG.value
  mesh, axis_rules = sharding.make_mesh(config.mesh), sharding.rules(config.mesh)
  model_config = TransformerConfig.from_config(config.model, data.vocab_size(config))
  abstract = translate.abstract_params(model_config, mesh, axis_rules)
  init = jax.jit(lambda: nn.meta.unbox(Transformer(model_config).init(
      jax.random.PRNGKey(0), jnp.ones((1, 1), jnp.int32), jnp.ones((1, 1), jnp.int32))[
          'params']), out_shardings=jax.tree.map(lambda s: s.sharding, abstract))
  with sharding.mesh_context(mesh, axis_rules):
    params = init()
  lengths = _source_lengths(_SENTENCES.value, _NUM_SENTENCES.value, _SUBWORDS_PER_WORD.value,
                            min(config.data.max_len, config.model.max_len))
  rng = np.random.default_rng(0)
  inputs = [np.append(rng.integers(2, model_config.vocab_size, n - 1), EOS_ID).astype(np.int32)
            for n in lengths]
  for beam_size in map(int, _BEAM_SIZES.value):
    translator = decode.Translator(model_config, mesh, axis_rules, config.data.batch_tokens,
                                   config.data.min_bucket, config.eval.max_extra_len,
                                   beam_size=beam_size, alpha=config.eval.alpha)
    batches = []
    start = time.perf_counter()
    outputs = translator.translate(params, inputs, progress=batches.append)
    first_seconds = time.perf_counter() - start
    seconds = common.median_seconds(lambda: translator.translate(params, inputs),
                                    _REPEATS.value, warmup=0)
    target_tokens = _output_tokens(outputs)
    print(cli.json_line({
        'benchmark': 'decode', 'config': config.name, **common.device_info(),
        'search': 'greedy' if beam_size == 1 else 'beam', 'beam_size': beam_size,
        'alpha': config.eval.alpha, 'dtype': config.model.dtype,
        'params': sum(x.size for x in jax.tree.leaves(params)),
        'sentences': len(inputs), 'batches': len(batches),
        'source_tokens': int(sum(lengths)), 'target_tokens': target_tokens,
        'max_extra_len': config.eval.max_extra_len, 'seconds': round(seconds, 3),
        'sentences_per_second': round(len(inputs) / seconds, 2),
        'target_tokens_per_second': round(target_tokens / seconds, 1),
        'compile_seconds': round(first_seconds - seconds, 2)}), flush=True)


if __name__ == '__main__':
  app.run(main)
