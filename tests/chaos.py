"""Chaos: a tiny text run killed at random moments, then completed, equals an uninterrupted run.

Kills land during vocabulary training, token-cache building, training steps and checkpoint
saves (SIGKILL), plus one SIGTERM, one Ctrl-C (SIGINT) and, where a tmpfs can be mounted (root),
one full disk during training (the launch must stop with one error line; the disk is then
freed); the moments come from a seeded RNG. The completed run's
final parameters, dropout key and data-iterator state must equal an uninterrupted run's bit
for bit, and no scratch file may remain. tests/test_checkpoint.py runs a few kills in CI;
`python tests/chaos.py --kills=20 --seed=N` runs many and prints one JSON line.
"""

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAVE_EVERY = 3
# Kill kind: (log line that starts the phase, longest delay after it in seconds). With the
# default 20,000 pairs the vocabulary trains for about 1.7 s, the training split is
# tokenised in about 0.2 s.
EARLY = {'vocab': (r'Training a \d+-piece', 1.2), 'cache': (r'Tokenising .* \(train\)', 0.15)}
# What a launch may leave only while it runs: scratch folders, orbax's unfinished saves, the lock.
LEFTOVER = re.compile(r'^\.vocab-|^\.building-|^tmp|orbax-checkpoint-tmp|^run\.lock')


def write_corpus(directory: str, pairs: int, seed: int = 0) -> dict[str, str]:
  """Parallel files of number words (English -> German); config.data keys to their paths."""
  english = ['one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine']
  german = ['eins', 'zwei', 'drei', 'vier', 'fuenf', 'sechs', 'sieben', 'acht', 'neun']
  rng = np.random.default_rng(seed)
  picks = [rng.integers(0, len(english), rng.integers(2, 7)) for _ in range(pairs)]
  sides = {'src': [' '.join(english[i] for i in p) for p in picks],
           'tgt': [' '.join(german[i] for i in p) for p in picks]}
  paths = {}
  for split, count in (('train', pairs), ('eval', 16)):
    for side, lines in sides.items():
      paths[f'{split}_{side}'] = os.path.join(directory, f'{split}.{side}')
      with open(paths[f'{split}_{side}'], 'w') as f:
        f.write(''.join(line + '\n' for line in lines[:count]))
  return paths


def command(workdir: str, corpus: dict[str, str], num_steps: int) -> list[str]:
  return [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
          f'--workdir={workdir}', '--config.data.source=text', '--config.data.vocab_size=40',
          *(f'--config.data.{key}={path}' for key, path in corpus.items()),
          f'--config.train.num_steps={num_steps}', f'--config.ckpt.every={SAVE_EVERY}',
          '--config.ckpt.keep=100', '--config.train.log_every=1',
          '--config.train.eval_every=100000', '--config.eval.bleu_sentences=0']


EXIT_CODES = {None: 0, 'sigterm': 128 + signal.SIGTERM, 'sigint': 128 + signal.SIGINT,
              'diskfull': 1}
FILLER = 'filler'  # The file that fills the disk of a 'diskfull' launch.


def fill_disk(directory: str) -> None:
  """Writes `directory`/FILLER until the file system holding it is full."""
  with open(os.path.join(directory, FILLER), 'wb') as f:
    try:
      while True:
        f.write(b'\0' * (1 << 20))
        f.flush()
    except OSError:
      pass


def launch(args: list[str], kind: str | None, rng: random.Random, disk: str = '') -> dict:
  """Runs one launch, interrupting it as `kind` says (None: to the end); what happened.

  'diskfull' fills `disk` (the file system of the workdir) and frees it after the launch.
  """
  env = dict(os.environ, PYTHONPATH=ROOT)
  process = subprocess.Popen(args, cwd=ROOT, env=env, stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
  sig = {'sigterm': signal.SIGTERM, 'sigint': signal.SIGINT}.get(kind, signal.SIGKILL)
  trigger, delay, target, armed, sent = None, 0.0, None, False, {}
  if kind in EARLY:
    trigger, longest = EARLY[kind]
    delay = rng.uniform(0, longest)
  lines = []

  def send(moment):
    if process.poll() is None and not sent:
      sent.update(moment=moment)
      if kind == 'diskfull':
        fill_disk(disk)
      else:
        process.send_signal(sig)

  for line in process.stderr:
    lines.append(line)
    if armed or kind is None:
      continue
    start = re.search(r'Training from step (\d+) to', line)
    if start and trigger is None:
      # The step kill lands mid-training, the save kill while the save at the next
      # multiple of SAVE_EVERY is being written (saves are asynchronous), SIGTERM anywhere.
      first = int(start.group(1)) + 1
      target = {'step': first + rng.randrange(2 * SAVE_EVERY),
                'save': first + (-first % SAVE_EVERY),
                'sigterm': first + rng.randrange(2 * SAVE_EVERY),
                'sigint': first + rng.randrange(2 * SAVE_EVERY),
                'diskfull': first + rng.randrange(SAVE_EVERY)}[kind]
      trigger, delay = rf'\] step {target}: loss', rng.uniform(0, 0.1) if kind == 'save' else 0
    elif start:  # An early phase was already done (its output exists): kill now instead.
      send('startup')
    if trigger and re.search(trigger, line):
      armed = True
      moment = kind if target is None else f'{kind} at step {target}'
      threading.Timer(delay, send, (f'{moment} +{delay:.3f}s',)).start()
  returncode = process.wait(timeout=300)
  if kind == 'diskfull' and os.path.exists(os.path.join(disk, FILLER)):
    os.remove(os.path.join(disk, FILLER))
  return {'kind': kind, 'returncode': returncode, 'moment': sent.get('moment'),
          'log': ''.join(lines)}


def leftovers(workdir: str) -> list[str]:
  """Paths in `workdir` that only a running or killed launch should have."""
  found = []
  for directory, folders, files in os.walk(workdir):
    found += [os.path.relpath(os.path.join(directory, name), workdir)
              for name in folders + files if LEFTOVER.search(name)]
  return sorted(found)


def plan(kills: int, rng: random.Random, disk_full: bool = True) -> list[str]:
  """Kill kinds in launch order: vocabulary, cache, then steps and saves, one SIGTERM, one
  Ctrl-C and (with `disk_full`) one full disk, each at a random place after the early ones."""
  kinds = ['vocab', 'cache'][:kills]
  offset = rng.randrange(2)
  kinds += [('step', 'save')[(i + offset) % 2] for i in range(kills - len(kinds))]
  for kind in ('sigterm', 'sigint') + (('diskfull',) if disk_full else ()):
    kinds.insert(rng.randint(min(2, kills), len(kinds)), kind)
  return kinds


def mount_tmpfs(directory: str, size: str = '512m') -> bool:
  """Mounts a tmpfs on `directory`; False where that is not allowed (not root, a container)."""
  os.makedirs(directory, exist_ok=True)
  return subprocess.run(['mount', '-t', 'tmpfs', '-o', f'size={size}', 'tmpfs', directory],
                        capture_output=True).returncode == 0


def run(kills: int, seed: int, root: str, pairs: int = 20_000) -> dict:
  """An uninterrupted run and one interrupted `kills` + 2 or 3 times, compared; the result."""
  from t2t_jax import checkpoint  # pylint: disable=g-import-not-at-top
  rng = random.Random(seed)
  corpus = write_corpus(root, pairs)
  num_steps = 12 + 6 * (kills + 2)  # Room for every kill to land before the end.
  disk = os.path.join(root, 'disk')
  disk_full = mount_tmpfs(disk)
  straight = os.path.join(root, 'straight')
  interrupted = os.path.join(disk if disk_full else root, 'interrupted')
  try:
    outcome = launch(command(straight, corpus, num_steps), None, rng)
    problems = [] if outcome['returncode'] == 0 else [
        f'uninterrupted run failed: {outcome["log"][-2000:]}']
    launches = []
    for kind in plan(kills, rng, disk_full) + [None]:
      outcome = launch(command(interrupted, corpus, num_steps), kind, rng, disk)
      launches.append({key: outcome[key] for key in ('kind', 'moment', 'returncode')})
      launches[-1]['left_behind'] = leftovers(interrupted)
      expected = EXIT_CODES.get(kind, -signal.SIGKILL)
      errors = [line for line in outcome['log'].splitlines() if line.startswith('error: ')]
      if outcome['returncode'] != expected or (kind and not outcome['moment']) or (
          kind == 'diskfull' and not (len(errors) == 1 and 'disk is full' in errors[0])):
        problems.append(f'launch {len(launches)} ({kind}) ended with {outcome["returncode"]}, '
                        f'signalled at {outcome["moment"]}: {outcome["log"][-2000:]}')
      if kind in ('sigint', 'diskfull') and launches[-1]['left_behind']:
        problems.append(f'launch {len(launches)} ({kind}) left {launches[-1]["left_behind"]}')
    if not problems:
      problems += compare(straight, interrupted, num_steps, checkpoint)
  finally:
    if disk_full:
      subprocess.run(['umount', disk], check=False)
  return {'seed': seed, 'kills': kills, 'num_steps': num_steps, 'ok': not problems,
          'disk_full': disk_full or 'skipped: a tmpfs cannot be mounted here',
          'problems': problems, 'launches': launches}


def compare(straight: str, interrupted: str, step: int, checkpoint) -> list[str]:
  """What differs between the two finished workdirs at `step`, and what is left over."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  problems = []
  items = []
  for workdir in (straight, interrupted):
    with ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'),
                               item_handlers=checkpoint._handlers()) as manager:  # pylint: disable=protected-access
      item_args = {'state': ocp.args.StandardRestore(), 'rng': ocp.args.StandardRestore(),
                   'data': ocp.args.JsonRestore()}
      items.append(manager.restore(step, args=ocp.args.Composite(**item_args)))
  for name in ('state', 'rng'):
    leaves = [_leaves(item[name]) for item in items]
    if len(leaves[0]) != len(leaves[1]) or not all(
        a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(*leaves)):
      problems.append(f'checkpoint {step}: {name} differs from the uninterrupted run')
  if items[0]['data'] != items[1]['data']:
    problems.append(f'data iterator state {items[1]["data"]} != {items[0]["data"]}')
  vocabularies = [open(os.path.join(w, 'vocab.model'), 'rb').read()
                  for w in (straight, interrupted)]
  if vocabularies[0] != vocabularies[1]:
    problems.append('the vocabularies differ')
  for workdir in (straight, interrupted):
    if left := leftovers(workdir):
      problems.append(f'{workdir} holds scratch files: {left}')
  return problems


def _leaves(tree) -> list[np.ndarray]:
  import jax  # pylint: disable=g-import-not-at-top
  return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--kills', type=int, default=20,
                      help='SIGKILLs (one SIGTERM, one Ctrl-C and one full disk more)')
  parser.add_argument('--seed', type=int, default=random.SystemRandom().randrange(2**31))
  parser.add_argument('--keep', action='store_true', help='keep the workdirs (printed)')
  options = parser.parse_args()
  sys.path.insert(0, ROOT)
  root = tempfile.mkdtemp(prefix='t2t_jax_chaos_')
  result = run(options.kills, options.seed, root)
  if options.keep:
    result['root'] = root
  else:
    import shutil  # pylint: disable=g-import-not-at-top
    shutil.rmtree(root, ignore_errors=True)
  print(json.dumps(result))
  sys.exit(0 if result['ok'] else 1)


if __name__ == '__main__':
  main()
