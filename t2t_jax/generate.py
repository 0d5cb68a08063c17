"""Continues prompts with a trained language model (config.data.source='lm'): a prompt a line
in, its continuation (after the prompt, unless --continuation_only) a line out, in order.

  echo "two young men" | python -m t2t_jax.generate --workdir=/tmp/lm --top_p=0.9 --seed=1
  python -m t2t_jax.generate --workdir=/tmp/lm --input=prompts.txt --output=out.txt --samples=3

An empty prompt starts from nothing. The draws depend on --seed, the prompt's line number and
the sample's number only (decoding/sampling.py); --temperature=0 is greedy.
"""

import sys

from absl import app
from absl import flags
from absl import logging
import tqdm

from t2t_jax import EOS_ID
from t2t_jax import cli
from t2t_jax.checkpoints import saved_params
from t2t_jax.decoding import sampling as sampling_lib
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.deploy import trained_run

FLAGS = flags.FLAGS


def generate(run: trained_run.Run, prompts: list[str], samples: int = 1,
             continuation_only: bool = False, progress: bool = False,
             name: str = '<stdin>') -> list[str]:
  """`samples` texts per prompt, one after the other: the prompt and what the model adds to
  it (or only that). `name` is the prompts' file, for messages."""
  max_tokens = run.model_config.max_len - 1  # One position left to generate at.
  inputs = trained_run.encode_lines(run.vocab, prompts, max_tokens, name, eos=False)
  with tqdm.tqdm(total=len(inputs) * samples, desc='generating', unit=' texts',
                 file=sys.stderr, disable=not progress) as bar:
    outputs = run.translator.translate(run.params, inputs, progress=bar.update, samples=samples)
  texts = []
  for index, ids in enumerate(outputs):
    ids = [int(i) for i in ids]
    ids = ids[:ids.index(EOS_ID)] if EOS_ID in ids else ids
    if continuation_only:
      ids = ids[len(inputs[index // samples]):]
    texts.append(run.vocab.decode(ids) if ids else '')
  return texts


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  if not FLAGS.workdir:
    raise app.UsageError('--workdir is required')
  if FLAGS.output:
    cli.check_output_path(FLAGS.output, '--output')
  prompts = cli.read_input_lines(FLAGS.input)
  policy = sampling_lib.Sampling(FLAGS.temperature, FLAGS.top_k, FLAGS.top_p, FLAGS.seed)
  run = trained_run.load(FLAGS.workdir, FLAGS.checkpoint, batch_tokens=FLAGS.batch_tokens,
                         dtype=FLAGS.dtype, weights=FLAGS.weights, sampling=policy,
                         language_model=True, max_extra_len=FLAGS.max_new_tokens)
  texts = generate(run, prompts, FLAGS.samples, FLAGS.continuation_only,
                   progress=bool(FLAGS.input), name=FLAGS.input or '<stdin>')
  stats = run.translator.stats
  logging.info('Generated %d texts in %.1f s (%.1f texts/s); %d shapes compiled in %.1f s',
               stats.sentences, stats.seconds, stats.sentences / max(stats.seconds, 1e-9),
               stats.shapes_compiled, stats.compile_seconds)
  text = ''.join(t + '\n' for t in texts)
  if FLAGS.output:
    with open(FLAGS.output, 'w', encoding='utf-8') as f:
      f.write(text)
  else:
    sys.stdout.write(text)
    sys.stdout.flush()


def _define_flags():
  """Defined only when run as a command, so importing this module defines no flags."""
  flags.DEFINE_string('workdir', None, 'A language model\'s run directory (configs/lm.py).')
  flags.DEFINE_string('checkpoint', None, 'A step of <workdir>/checkpoints, or the path of a '
                      'checkpoint directory (e.g. an averaged one); default: the latest step.')
  flags.DEFINE_enum('weights', 'params', list(saved_params.WEIGHTS), 'Which weights of the '
                    f'checkpoint generate. {saved_params.WEIGHTS_HELP}')
  flags.DEFINE_string('input', '', 'Prompts, one per line; empty: stdin.')
  flags.DEFINE_string('output', '', 'Where the texts go, one per line; empty: stdout.')
  flags.DEFINE_integer('max_new_tokens', 50, 'Tokens generated after a prompt, at most (and '
                       "at most the model's max_len in all).", lower_bound=1)
  flags.DEFINE_float('temperature', 1.0, 'Draw from the softmax of logits / this; 0 is greedy.',
                     lower_bound=0.0)
  flags.DEFINE_integer('top_k', 0, 'Draw from the k likeliest tokens only; 0: all.',
                       lower_bound=0)
  flags.DEFINE_float('top_p', 1.0, 'Draw from the smallest set of likeliest tokens holding '
                     'this much probability (nucleus sampling); 1: all.')
  flags.DEFINE_integer('seed', 0, 'The draws depend on it, the prompt\'s line and the sample\'s '
                       'number only.')
  flags.DEFINE_integer('samples', 1, 'Texts per prompt, one after the other.', lower_bound=1)
  flags.DEFINE_bool('continuation_only', False, 'Write what follows the prompt only.')
  flags.DEFINE_integer('batch_tokens', None, 'Tokens per batch (rows x padded prompt length). '
                       'Default: config.data.batch_tokens.')
  flags.DEFINE_enum('dtype', None, list(translator_lib.DECODE_DTYPES), 'Activations: auto '
                    '(bfloat16 on GPU/TPU, float32 on CPU), model, float32 or bfloat16. '
                    'Default: config.eval.dtype.')


def run():
  _define_flags()
  cli.run(main)


if __name__ == '__main__':
  run()
