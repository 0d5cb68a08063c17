"""Fingerprints of the optimised HLO of a config's train step and searches, to show that a
change of code leaves the compiled programs as they were.

  python bench/hlo_fingerprint.py --config=configs/tiny.py
  python bench/hlo_fingerprint.py --config=configs/tiny.py --config.model.positions=rotary \
      --run --dump_dir=/tmp/hlo

Programs are lowered and compiled the way the product does: the train step from setup.build,
the searches as translator.py jits them (search_function, runtime.jit_search). Prints one
JSON line per program: the sha256 and length of its optimised HLO text without metadata
and the stack-frame tables it points into (source files, lines, Python scopes), and the sha256 of that text with every `%name`
renumbered by first appearance (equal when two programs differ only in value names). With
--run, also one line per search run on the config's freshly initialised parameters: sha256 of
its outputs (greedy tokens; beam tokens and scores) and the scores themselves.
"""

import functools
import hashlib
import json
import re

from absl import flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from t2t_jax import cli
from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax.compile import dry_run
from t2t_jax.data import pipeline
from t2t_jax.decoding import decode
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.model import prng
from t2t_jax.training import build as setup_lib

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/tiny.py', 'Config to compile.')
_BEAM = flags.DEFINE_integer('beam_size', 4, 'Beam width of the beam search program.')
_ROWS = flags.DEFINE_integer('rows', 4, 'Source rows of the search programs.')
_LENGTH = flags.DEFINE_integer('length', 8, 'Padded source length of the search programs.')
_RUN = flags.DEFINE_boolean('run', False, 'Also run the searches and fingerprint outputs.')
_DUMP = flags.DEFINE_string('dump_dir', '', 'Also write each hashed text here, to diff.')

# Quoted strings may hold braces; metadata never nests braces otherwise.
_METADATA = re.compile(r',? ?metadata=\{(?:[^{}"]|"(?:[^"\\]|\\.)*")*\}')
# The tables of source files, functions and lines that metadata's stack frames point into.
_SOURCE_TABLES = re.compile(r'^(FileNames|FunctionNames|FileLocations|StackFrames)\n.*?\n\n',
                            re.MULTILINE | re.DOTALL)
_NAME = re.compile(r'%[\w.\-]+')


def fingerprint(program: str, config_name: str, hlo_text: str) -> dict:
  """The hashes of `hlo_text` without metadata: as it is, and with names renumbered."""
  text = _SOURCE_TABLES.sub('', _METADATA.sub('', hlo_text))
  if _DUMP.value:
    with open(f'{_DUMP.value}/{program}.hlo', 'w') as f:
      f.write(text)
  names = {}
  canonical = _NAME.sub(lambda m: names.setdefault(m.group(0), f'%v{len(names)}'), text)
  return {'program': program, 'config': config_name, 'device': jax.devices()[0].device_kind,
          'device_count': jax.device_count(), 'chars': len(text),
          'sha256': hashlib.sha256(text.encode()).hexdigest(),
          'renamed_sha256': hashlib.sha256(canonical.encode()).hexdigest()}


def _search_programs(config, setup, platform: str):
  """(name, jitted search, max_len) of greedy and beam search, as translator.py makes them."""
  model_config = translator_lib.decoding_config(setup.model_config, config.eval.dtype, platform)
  max_len = decode.max_decode_length(_LENGTH.value, config.eval.max_extra_len,
                                     model_config.max_len, model_config.kind == 'decoder_only')
  replicated = jax.sharding.NamedSharding(setup.mesh, jax.sharding.PartitionSpec())
  for name, beam in (('greedy', 1), ('beam', _BEAM.value)):
    search = translator_lib.search_function(model_config, max_len, beam, config.eval.alpha,
                                            config.eval.length_penalty)
    yield (name, runtime.jit_search(search, platform, out_shardings=replicated), model_config,
           max_len)


def _sources(vocab: int) -> np.ndarray:
  """Fixed source rows, right-padded to different lengths."""
  rng = np.random.default_rng(0)
  inputs = rng.integers(2, vocab, (_ROWS.value, _LENGTH.value)).astype(np.int32)
  for row in range(_ROWS.value):
    inputs[row, _LENGTH.value - row % _LENGTH.value:] = 0
  return inputs


def _run(name: str, config, setup, params, model_config, max_len: int, platform: str) -> dict:
  """One search on `params` over fixed sources: its outputs' hash and its scores."""
  inputs = jnp.asarray(_sources(model_config.vocab_size))
  if name == 'greedy':
    search = functools.partial(decode.greedy_search, config=model_config, max_len=max_len)
  else:
    search = functools.partial(decode.beam_search, config=model_config, max_len=max_len,
                               beam_size=_BEAM.value, alpha=config.eval.alpha,
                               penalty=config.eval.length_penalty)
  with sharding.mesh_context(setup.mesh, setup.axis_rules):
    outputs = runtime.jit_search(search, platform)(params, inputs)
  outputs = [np.asarray(x) for x in jax.tree.leaves(outputs)]
  digest = hashlib.sha256(b''.join(x.tobytes() for x in outputs)).hexdigest()
  scores = outputs[1].round(5).tolist() if len(outputs) > 1 else None
  return {'run': name, 'config': config.name, 'outputs_sha256': digest, 'scores': scores}


def main(_):
  config = _CONFIG.value
  setup = setup_lib.build(config, pipeline.vocab_size(config))
  platform = setup.mesh.devices.flat[0].platform
  name = f'{config.name}:{config.model.positions}:{config.model.attention_pattern}:' \
         f'{config.model.kind}:{config.model.dtype}'
  batch, _, _ = dry_run.abstract_batch(config, setup.mesh)
  rng = jax.eval_shape(functools.partial(prng.dropout_key, name=config.model.dropout_prng),
                       jax.ShapeDtypeStruct((2,), jnp.uint32))
  train = setup.train_step.lower(setup.abstract_state, batch, rng).compile()
  print(json.dumps(fingerprint('train_step', name, train.as_text())), flush=True)
  batch_sharding = sharding.batch_sharding(setup.mesh)
  inputs = jax.ShapeDtypeStruct((_ROWS.value, _LENGTH.value), jnp.int32, sharding=batch_sharding)
  limits = jax.ShapeDtypeStruct((_ROWS.value,), jnp.int32, sharding=batch_sharding)
  params = setup.init(jax.random.PRNGKey(0)).params if _RUN.value else None
  for program, search, model_config, max_len in _search_programs(config, setup, platform):
    with sharding.mesh_context(setup.mesh, setup.axis_rules):
      compiled = search.lower(setup.abstract_state.params, inputs,
                              max_lengths_B=limits).compile()
    print(json.dumps(fingerprint(program, name, compiled.as_text())), flush=True)
    if params is not None:
      print(json.dumps(_run(program, config, setup, params, model_config, max_len, platform)),
            flush=True)


if __name__ == '__main__':
  cli.run(main, compilation_cache=None)  # Compiled afresh, as the product compiles.
