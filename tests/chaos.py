"""Chaos: a tiny text run killed at random moments, then completed, equals an uninterrupted run.

Kills land during vocabulary training, token-cache building, training steps and checkpoint
saves (SIGKILL), plus one SIGTERM, one Ctrl-C (SIGINT) and, where a tmpfs can be mounted (root),
one full disk during training (the launch must stop with one error line; the disk is then
freed); the moments come from a seeded RNG. The later of the SIGTERM and Ctrl-C launches runs
on another shape (MOVED: fewer devices, another mesh) and must say so in one line, as must the
next launch, back home. Each launch must train on from the newest checkpoint the ones before
it finished writing (a save in flight at a kill is absent). At every checkpoint of the
completed run the data-iterator state and the dropout key must equal an uninterrupted run's
bit for bit; the parameters and optimiser state too up to the move, and after it (sums in
another order) within the bound of conftest.assert_adam_runs_agree; the training losses
likewise. No scratch file may remain. tests/test_checkpoint.py runs a few kills in CI (the
suite's kill -9 test, with the other signals and a full disk); `python tests/chaos.py
--kills=20 --seed=N` runs many and prints one JSON line.
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
# Where the launches run, as the test suite's processes do: 8 simulated CPU devices, the batch
# split 8 ways over the data axis, so the run's rows come in multiples of 8. The moved launch
# runs on 4 devices as fsdp=2 x tensor=2: 2 batch shards, the weights split 4 ways.
HOME = {'devices': 8, 'mesh': '(-1,1,1)'}
MOVED = {'devices': 4, 'mesh': '(1,2,2)'}
MOVED_LINE = re.compile(r'Resuming \S+ on another shape: ')  # resolve.check_resume's warning.
LOSS_RTOL = 1e-5  # Training losses after the move against the uninterrupted run's.
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


def command(workdir: str, corpus: dict[str, str], num_steps: int, every: int = SAVE_EVERY,
            shape: dict = HOME) -> list[str]:
  """The run's command line, saving every `every` steps (keeping all), on `shape`'s mesh."""
  return [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py',
          f'--workdir={workdir}', '--config.data.source=text', '--config.data.vocab_size=40',
          *(f'--config.data.{key}={path}' for key, path in corpus.items()),
          f'--config.train.num_steps={num_steps}', f'--config.ckpt.every={every}',
          f'--config.ckpt.keep={num_steps}', '--config.train.log_every=1',
          '--config.train.eval_every=100000', '--config.eval.bleu_sentences=0',
          # At tiny.py's rate (peak 0.08) this run amplifies float32 rounding by orders of
          # magnitude a step after the warmup: runs that differ only in the order of their sums
          # (4 devices against 8) part by 1e-7 at step 18 and 1e-2 at step 33 (losses), beyond
          # any bound after a move; at an eighth of it by 6e-4 at step 99. At a twentieth (peak
          # 0.004), 144 steps (--kills=20) stay within 2e-7, and the loss still falls 3.4 -> 1.3.
          '--config.opt.lr_scale=0.1', f'--config.mesh.shape={shape["mesh"]}']


def cpu_environment(devices: int) -> dict[str, str]:
  """os.environ for a process that sees `devices` simulated CPU devices and no accelerator."""
  flags = re.sub(r'--xla_force_host_platform_device_count=\S*', '',
                 os.environ.get('XLA_FLAGS', ''))
  return dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS='cpu',
              XLA_FLAGS=f'{flags} --xla_force_host_platform_device_count={devices}'.strip())


def checkpoint_steps(workdir: str) -> list[int]:
  """The steps of `workdir`'s finished checkpoints, in order."""
  directory = os.path.join(workdir, 'checkpoints')
  names = os.listdir(directory) if os.path.isdir(directory) else []
  return sorted(int(name) for name in names if name.isdigit())


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


def launch(args: list[str], kind: str | None, rng: random.Random, disk: str = '',
           devices: int = HOME['devices']) -> dict:
  """Runs one launch on `devices` CPU devices, interrupting it as `kind` says (None: to the
  end); what happened.

  'diskfull' fills `disk` (the file system of the workdir) and frees it after the launch.
  """
  env = cpu_environment(devices)
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
  """An uninterrupted run and one interrupted `kills` + 2 or 3 times, one launch on MOVED,
  compared; the result."""
  rng = random.Random(seed)
  corpus = write_corpus(root, pairs)
  num_steps = 12 + 6 * (kills + 2)  # Room for every kill to land before the end.
  disk = os.path.join(root, 'disk')
  disk_full = mount_tmpfs(disk)
  straight = os.path.join(root, 'straight')
  interrupted = os.path.join(disk if disk_full else root, 'interrupted')
  kinds = plan(kills, rng, disk_full) + [None]
  # The earlier of the two signals saved a checkpoint at home for it to resume from; it saves
  # where its own signal stops it, and the next launch resumes from there: the completed run
  # holds the steps it took.
  move = {'launch': max(kinds.index('sigterm'), kinds.index('sigint')) + 1, **MOVED,
          'from_step': None, 'saved': []}
  try:
    # Saving every step changes no number; the bound after the move reads every step's Adam
    # moments. The chaos launches save every SAVE_EVERY, to keep kills in steps and in saves
    # apart. The uninterrupted run goes on beside them, on the second core (it draws no kill).
    reference = {}
    reference_thread = threading.Thread(target=lambda: reference.update(
        launch(command(straight, corpus, num_steps, every=1), None, random.Random(seed))))
    reference_thread.start()
    problems, launches = [], []
    saved_on = {}  # Checkpoint step -> the shape of the launch that wrote it.
    for number, kind in enumerate(kinds, start=1):
      shape = MOVED if number == move['launch'] else HOME
      before = checkpoint_steps(interrupted)
      resumed = before[-1] if before else None  # A launch resumes from the newest checkpoint.
      outcome = launch(command(interrupted, corpus, num_steps, shape=shape), kind, rng, disk,
                       shape['devices'])
      saved = sorted(set(checkpoint_steps(interrupted)) - set(before))
      saved_on.update(dict.fromkeys(saved, shape))
      launches.append({key: outcome[key] for key in ('kind', 'moment', 'returncode')})
      launches[-1]['left_behind'] = leftovers(interrupted)
      launches[-1]['said_moved'] = bool(MOVED_LINE.search(outcome['log']))
      if number == move['launch']:
        move.update(from_step=resumed, saved=saved)
      expected = EXIT_CODES.get(kind, -signal.SIGKILL)
      errors = [line for line in outcome['log'].splitlines() if line.startswith('error: ')]
      if outcome['returncode'] != expected or (kind and not outcome['moment']) or (
          kind == 'diskfull' and not (len(errors) == 1 and 'disk is full' in errors[0])):
        problems.append(f'launch {number} ({kind}) ended with {outcome["returncode"]}, '
                        f'signalled at {outcome["moment"]}: {outcome["log"][-2000:]}')
      if kind in ('sigint', 'diskfull') and launches[-1]['left_behind']:
        problems.append(f'launch {number} ({kind}) left {launches[-1]["left_behind"]}')
      # It trained on from the newest checkpoint the launches before it finished writing.
      started = re.search(r'Training from step (\d+) to', outcome['log'])
      if started and int(started.group(1)) != (resumed or 0):
        problems.append(f'launch {number} ({kind}) trained from step {started.group(1)}, not '
                        f'from the newest finished checkpoint ({resumed})')
      # It says it moved where that checkpoint was saved on another shape.
      if launches[-1]['said_moved'] != (resumed is not None and saved_on[resumed] != shape):
        problems.append(
            f'launch {number} ({kind}) on {shape} resumed from step {resumed} saved on '
            f'{saved_on.get(resumed)} and {"said" if launches[-1]["said_moved"] else "did not say"}'
            f' it moved: {outcome["log"][-2000:]}')
    if not move['from_step']:
      problems.append(f'the moved launch found no checkpoint to resume from: {move}')
    reference_thread.join()
    if reference['returncode'] != 0:
      problems.append(f'uninterrupted run failed: {reference["log"][-2000:]}')
    if not problems:
      problems += compare(straight, interrupted, num_steps, move['from_step'], move)
  finally:
    if disk_full:
      subprocess.run(['umount', disk], check=False)
  return {'seed': seed, 'kills': kills, 'num_steps': num_steps, 'ok': not problems,
          'disk_full': disk_full or 'skipped: a tmpfs cannot be mounted here', 'move': move,
          'problems': problems, 'launches': launches}


def compare(straight: str, interrupted: str, num_steps: int, moved_from: int,
            figures: dict) -> list[str]:
  """What differs between the two finished workdirs, of runs to `num_steps` the second of
  which moved after step `moved_from`, and what is left over. Adds to `figures` how close the
  moved run came: the largest share of the bound a weight used, the largest relative change
  of a training loss."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  from t2t_jax.checkpoints import checkpoint  # pylint: disable=g-import-not-at-top
  problems = []
  steps = checkpoint_steps(interrupted)
  if steps[-1] != num_steps or not set(steps) <= set(checkpoint_steps(straight)):
    return [f'checkpoints {steps} of the interrupted run, {checkpoint_steps(straight)} of the '
            f'uninterrupted one']
  items, states = {}, {w: _saved_states(w) for w in (straight, interrupted)}
  for workdir in (straight, interrupted):
    with ocp.CheckpointManager(os.path.join(workdir, 'checkpoints'),
                               item_handlers=checkpoint._handlers()) as manager:  # pylint: disable=protected-access
      item_args = {'rng': ocp.args.PyTreeRestore(), 'data': ocp.args.JsonRestore()}
      items[workdir] = {step: manager.restore(step, args=ocp.args.Composite(**item_args))
                        for step in steps}
  for step in steps:
    reference, item = items[straight][step], items[interrupted][step]
    if not _equal(item['rng'], reference['rng']):
      problems.append(f'checkpoint {step}: the dropout key differs from the uninterrupted run')
    if item['data'] != reference['data']:
      problems.append(f'checkpoint {step}: data iterator state {item["data"]} != '
                      f'{reference["data"]}')
    if step <= moved_from and not _equal(*(states[w](step) for w in (straight, interrupted))):
      problems.append(f'checkpoint {step}: state differs from the uninterrupted run')
  problems += _moved_state_problems(states, straight, interrupted,
                                    [s for s in steps if s > moved_from], figures)
  problems += _loss_problems(straight, interrupted, moved_from, figures)
  vocabularies = [open(os.path.join(w, 'vocab.model'), 'rb').read()
                  for w in (straight, interrupted)]
  if vocabularies[0] != vocabularies[1]:
    problems.append('the vocabularies differ')
  for workdir in (straight, interrupted):
    if left := leftovers(workdir):
      problems.append(f'{workdir} holds scratch files: {left}')
  return problems


def _moved_state_problems(states: dict, straight: str, interrupted: str, steps: list[int],
                          figures: dict) -> list[str]:
  """Where the interrupted run's parameters at `steps` (after its move) leave the bound of
  conftest.assert_adam_runs_agree around the uninterrupted run's, which saved every step.

  That bound also holds the run's first step to the reference's within the noise; the
  interrupted run does not save step 1, but it took that step on the reference's shape and its
  checkpoints up to the move equal the reference's bit for bit (compare), so the reference's
  step 1 stands for its own there.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import ml_collections  # pylint: disable=g-import-not-at-top
  from conftest import assert_adam_runs_agree  # pylint: disable=g-import-not-at-top
  from t2t_jax import as_asked  # pylint: disable=g-import-not-at-top
  from t2t_jax.training import optim  # pylint: disable=g-import-not-at-top
  if not steps:
    return ['no checkpoint after the move']
  with open(os.path.join(straight, 'config.json')) as f:
    config = ml_collections.ConfigDict(as_asked(json.load(f)))
  schedule = optim.learning_rate_schedule(config.opt, config.model.d_model,
                                          config.train.num_steps)
  rates = [float(schedule(step - 1)) for step in range(1, steps[-1] + 1)]
  reference = [(state['params'], state['opt_state']) for state in
               (states[straight](step) for step in range(1, steps[-1] + 1))]
  problems, shares = [], [0.0]
  for step in steps:
    state = states[interrupted](step)
    try:
      bound = assert_adam_runs_agree([reference[0], (state['params'], state['opt_state'])],
                                     reference[:step], rates[:step], config.opt.b1, config.opt.b2)
    except AssertionError as e:
      problems.append(f'checkpoint {step} (after the move): parameters {e}')
      continue
    for actual, expected, limit in zip(*(jax.tree.leaves(p) for p in (
        state['params'], reference[step - 1][0])), bound, strict=True):
      shares.append(float(np.max(np.abs(actual.astype(np.float64) - expected) /
                                 (limit + 1e-6 * np.abs(expected)))))
  figures['share_of_bound'] = max(shares)
  return problems


def _loss_problems(straight: str, interrupted: str, moved_from: int,
                   figures: dict) -> list[str]:
  """Where the training losses of the interrupted run (of each step, its last launch's) differ
  from the uninterrupted run's: at all up to step `moved_from`, beyond LOSS_RTOL after it.

  A SIGKILL loses the events its launch had not yet written, so the interrupted run may lack
  some steps, but never those of its last launch, which ran to the end.
  """
  from t2t_jax import plot  # pylint: disable=g-import-not-at-top
  expected_losses, losses = (dict(zip(series.steps, series.values)) for series in (
      plot.read_scalars(w)['train/loss'] for w in (straight, interrupted)))
  if not set(losses) <= set(expected_losses) or max(expected_losses) not in losses:
    return [f'training losses logged at steps {sorted(losses)}, of {sorted(expected_losses)}']
  problems, changes = [], [0.0]
  for step, actual in sorted(losses.items()):
    expected = expected_losses[step]
    if step <= moved_from:
      agree = actual == expected
    else:
      changes.append(abs(actual - expected) / abs(expected))
      agree = changes[-1] <= LOSS_RTOL
    if not agree:
      problems.append(f'training loss at step {step}: {actual} != {expected}')
  figures['loss_change'] = max(changes)
  return problems


def _saved_states(workdir: str):
  """A function of a step: the `state` item of `workdir`'s checkpoint there as numpy arrays,
  whatever mesh saved it. Every checkpoint of a run holds the same tree: it reads that once."""
  import jax  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  path = lambda step: os.path.join(workdir, 'checkpoints', str(step), 'state')
  checkpointer = ocp.PyTreeCheckpointer()
  tree = checkpointer.metadata(path(checkpoint_steps(workdir)[0])).item_metadata.tree
  args = ocp.args.PyTreeRestore(item=tree, restore_args=jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
  return lambda step: checkpointer.restore(path(step), args=args)


def _equal(a, b) -> bool:
  """Whether two trees hold the same arrays, dtypes and bits."""
  import jax  # pylint: disable=g-import-not-at-top
  leaves = [[np.asarray(leaf) for leaf in jax.tree.leaves(tree)] for tree in (a, b)]
  return len(leaves[0]) == len(leaves[1]) and all(
      x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(*leaves))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--kills', type=int, default=20,
                      help='SIGKILLs (one SIGTERM, one Ctrl-C and one full disk more)')
  parser.add_argument('--seed', type=int, default=random.SystemRandom().randrange(2**31))
  parser.add_argument('--keep', action='store_true', help='keep the workdirs (printed)')
  options = parser.parse_args()
  sys.path.insert(0, ROOT)
  os.environ.update(cpu_environment(HOME['devices']))  # Before jax loads: it reads checkpoints.
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
