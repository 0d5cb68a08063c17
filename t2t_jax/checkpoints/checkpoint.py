"""Training checkpoints: async saves, exact resume, damaged-checkpoint fallback, failed saves.

A training checkpoint is `<workdir>/checkpoints/<step>/` with four orbax items:
`state` (TrainState: step, params, opt_state, and ema when opt.ema_decay > 0), `rng` (the
dropout key), `data` (the grain iterator state, JSON) and `config` (the resolved config, JSON). A params-only checkpoint
(averaged or exported) is a directory with the items `params`, `config` and `info`; reading
params from either kind, averaging and writing them is saved_params.py's.
"""

import dataclasses
import errno
import json
import os
import shutil
import sys
import time
import traceback
from typing import Any

from absl import logging
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers

from t2t_jax import as_asked
from t2t_jax import CheckpointError
from t2t_jax import ConfigError
from t2t_jax.checkpoints import saved_params
from t2t_jax.checkpoints.saved_params import CONFIG, STATE
from t2t_jax import workdir_layout

RNG, DATA = 'rng', 'data'  # Items of a training checkpoint beside STATE and CONFIG.
# Config keys a resume may change: where, how often and how fast the run computes, what it
# evaluates and saves, and where its data lies; not what it trains. Each change is logged.
MAY_CHANGE = ('name', 'train.', 'eval.', 'ckpt.', 'mesh.', 'opt.grad_accum_steps',
              'opt.loss_chunk_tokens', 'opt.loss_impl', 'opt.ema_decay', 'model.remat',
              'model.attention_impl', 'model.dtype', 'data.data_dir', 'data.cache_dir', 'data.tfds_data_dir',
              'data.tfds_manual_dir', 'data.row_multiple')
TMP_MARK = '.orbax-checkpoint-tmp'  # In the name of a folder orbax has not finished writing.


@dataclasses.dataclass
class Restored:
  """What a training checkpoint holds."""
  step: int
  state: Any
  rng: jax.Array
  data_state: dict
  config_json: str


def _handlers() -> dict:
  return {STATE: saved_params.arrays_handler(), RNG: saved_params.arrays_handler(),
          DATA: ocp.JsonCheckpointHandler(), CONFIG: ocp.JsonCheckpointHandler()}


def _key_data(rng: jax.Array) -> jax.Array:
  """The raw uint32 words of a key, typed (jax.random.key) or not (jax.random.PRNGKey)."""
  return jax.random.key_data(rng) if jax.dtypes.issubdtype(rng.dtype,
                                                            jax.dtypes.prng_key) else rng


def _all_processes_agree(ok: bool) -> bool:
  """True only if `ok` holds on every process (a collective in multi-process runs)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


class Checkpointer:
  """Saves asynchronously every `ckpt.every` steps; keeps the last `ckpt.keep` and every
  `ckpt.keep_every`-th; restores the newest intact checkpoint."""

  def __init__(self, workdir: str, ckpt_config):
    _drop_late_writer_callbacks()  # Library noise after a failed save: see there.
    self.workdir = os.path.abspath(workdir)
    self.directory = workdir_layout.checkpoints_dir(self.workdir)
    self.every = ckpt_config.every
    policies = [checkpoint_managers.LatestN(n=ckpt_config.keep)]
    if ckpt_config.keep_every > 0:
      policies.append(checkpoint_managers.EveryNSteps(interval_steps=ckpt_config.keep_every))
    options = ocp.CheckpointManagerOptions(
        create=True, enable_async_checkpointing=True, cleanup_tmp_directories=True,
        preservation_policy=checkpoint_managers.AnyPreservationPolicy(policies))
    self.manager = ocp.CheckpointManager(self.directory, options=options,
                                         item_handlers=_handlers())
    self._in_flight = None  # Step of the asynchronous save not yet known to have finished.
    self._existing = set()  # Steps saved before the save in flight started.
    self._failure_reported = False  # A failed save raised its CheckpointError.

  def should_save(self, step: int) -> bool:
    return self.every > 0 and step % self.every == 0

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, rng: jax.Array, data_state: dict, config_json: str) -> bool:
    """Starts an asynchronous save; returns once the arrays are copied off the device.

    A failed save (full disk, lost permissions), whether it fails here or later in the
    background (`check`), raises CheckpointError naming the directory and the cause, after
    removing the unfinished checkpoint; the previous one is intact.
    """
    self._wait()
    self._existing = set(self.manager.all_steps())
    try:
      with saved_params.unretrieved_task_errors_dropped():
        self.manager.save(step, args=ocp.args.Composite(**{
            STATE: ocp.args.PyTreeSave(saved_tree(state)),
            # A host numpy value: every process holds the same key, the primary one writes it.
            RNG: ocp.args.PyTreeSave({'dropout': np.asarray(jax.device_get(_key_data(rng)))}),
            DATA: ocp.args.JsonSave(data_state),
            CONFIG: ocp.args.JsonSave({'config': config_json})}), force=True)
    except Exception as e:  # pylint: disable=broad-exception-caught
      self._failed(step, e)
    self._in_flight = step
    return True

  def check(self) -> None:
    """Raises CheckpointError if the save in flight has failed; never waits for one running."""
    if self._in_flight is not None and not self.manager.is_saving_in_progress():
      self._wait()

  def _wait(self) -> None:
    """Blocks until the save in flight is written; raises CheckpointError if it failed."""
    step, self._in_flight = self._in_flight, None
    try:
      with saved_params.unretrieved_task_errors_dropped():
        self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-exception-caught
      self._failed(step, e)

  def _failed(self, step, error: BaseException) -> None:
    self._failure_reported = True
    self.remove_unfinished(step)
    self.manager.reload()
    text = str(error)
    full = ((isinstance(error, OSError) and error.errno == errno.ENOSPC) or
            'No space left on device' in text)
    cause = 'the disk is full (No space left on device)' if full else saved_params.describe_error(error)
    latest = self.manager.latest_step()
    if latest is None:
      kept, rerun = 'there is no intact checkpoint yet', 'start again'
    else:
      kept, rerun = f'the newest intact one is step {latest}', 'resume from it'
    raise CheckpointError(
        f'saving checkpoint {step} in {self.directory} failed: {cause}. Training stopped; the '
        f'unfinished checkpoint was removed and {kept}. '
        f'{"Free space" if full else "Fix the cause"} (or use a --workdir on another disk, '
        f'copying the checkpoints) and rerun the same command to {rerun}.') from error

  def remove_unfinished(self, step: int | None = None) -> None:
    """Removes orbax's temporary folders of unfinished saves, and step `step` if a failed
    save of it got as far as its final name; safe to call while a save is running (a
    save abandoned: failed, or a second Ctrl-C)."""
    if jax.process_index() != 0 or not os.path.isdir(self.directory):
      return
    for _ in range(20):  # Writer threads of a failed save may still be finishing their files.
      names = [name for name in os.listdir(self.directory)
               if TMP_MARK in name or (step is not None and name == str(step) and
                                       step not in self._existing)]
      if not names:
        return
      for name in names:
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
      time.sleep(0.05)

  def latest_config(self) -> tuple[str, str] | None:
    """(path, saved config JSON) of the newest checkpoint whose config reads, or None: what a
    resume continues, read before the data and the arrays. The restore itself checks the
    checkpoint it settles on (an older one, if the newest is damaged)."""
    for step in sorted(self.manager.all_steps(), reverse=True):
      read, _ = saved_params.read_or_describe(lambda: self.manager.restore(  # pylint: disable=cell-var-from-loop
          step, args=ocp.args.Composite(**{CONFIG: ocp.args.JsonRestore()}))[CONFIG]['config'])
      if read is not None:
        return os.path.join(self.directory, str(step)), read
    return None

  def restore(self, abstract_state, config: ml_collections.ConfigDict,
              rng_shape: tuple[int, ...] = (2,)) -> Restored | None:
    """The newest intact checkpoint, or None if there is none.

    A damaged checkpoint is moved to `<workdir>/damaged_checkpoints/` with a warning and the
    previous one is tried. A checkpoint whose arrays do not fit `abstract_state` and a dropout
    key of `rng_shape` (the config changes shapes) raises CheckpointError; other config
    differences are logged.
    """
    rng_abstract = {'dropout': np.zeros(rng_shape, np.uint32)}
    steps, damaged = sorted(self.manager.all_steps(), reverse=True), []
    for index, step in enumerate(steps):
      path = os.path.join(self.directory, str(step))
      read, error = saved_params.read_or_describe(
          lambda: self._read(step, path, abstract_state, rng_abstract, config))  # pylint: disable=cell-var-from-loop
      if _all_processes_agree(error is None):
        restored, saved_config, target = read
        logging.info('Restored checkpoint %s', path)
        for bad in damaged:  # Only now: an intact older one proves the reading code works.
          logging.warning('Moved damaged checkpoint %d to %s', bad, self._move_damaged(bad))
        return Restored(step, target.replace(**restored[STATE]),
                        jnp.asarray(restored[RNG]['dropout']), restored[DATA], saved_config)
      damaged.append(step)
      fallback = (f'falling back to step {steps[index + 1]}' if index + 1 < len(steps) else
                  'no older checkpoint is left')
      logging.warning('Checkpoint %s is damaged (%s); %s.', path,
                      error or 'unreadable on another process', fallback)
    if steps:
      raise CheckpointError(
          f'every checkpoint in {self.directory} is unreadable (steps {steps}; causes logged '
          'above). Refusing to start from scratch silently: repair or remove them, or use a '
          'new --workdir.')
    return None

  def _read(self, step: int, path: str, abstract_state, rng_abstract, config):
    """Checkpoint `step`'s arrays, its config, and the state tree they were read into; raises
    CheckpointError where its shapes do not fit this config."""
    saved_config = self.manager.restore(step, args=ocp.args.Composite(**{
        CONFIG: ocp.args.JsonRestore()}))[CONFIG]['config']
    arrays = {**saved_params.saved_shapes(os.path.join(path, STATE)),
              **saved_params.saved_shapes(os.path.join(path, RNG))}
    target = _without_missing_ema(path, abstract_state, arrays)
    check_compatible(path, arrays, (target, rng_abstract), saved_config, config)
    restored = self.manager.restore(step, args=ocp.args.Composite(**{
        STATE: saved_params.arrays_restore(saved_tree(target)),
        RNG: saved_params.arrays_restore(rng_abstract),
        DATA: ocp.args.JsonRestore()}))
    return restored, saved_config, target

  def _move_damaged(self, step: int) -> str:
    """Moves a damaged step out of the manager's view, so a new save can reuse its number."""
    target = os.path.join(self.workdir, 'damaged_checkpoints', f'{step}-{int(time.time())}')
    if jax.process_index() == 0:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      shutil.move(os.path.join(self.directory, str(step)), target)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f't2t_jax_moved_damaged_{step}')
    self.manager.reload()
    return target

  def average_last(self, count: int, abstract_params):
    """Float32 mean of the params of the last `count` checkpoints (fewer if fewer exist)."""
    self._wait()
    steps = self.manager.all_steps()[-count:]
    if len(steps) < count:
      logging.info('Averaging %d checkpoints (%d asked for): only these exist', len(steps),
                   count)
    paths = [os.path.join(self.directory, str(step)) for step in steps]
    return saved_params.average([saved_params.load_params(path, abstract_params) for path in paths]), steps

  def close(self) -> None:
    """Waits for the save in flight; raises CheckpointError if it failed."""
    try:
      self._wait()
    finally:
      self._close_manager()

  def _close_manager(self) -> None:
    """Closes orbax's manager. Where the finalize thread of a failed save failed first (on the
    checkpoint's metadata) orbax's async checkpointer keeps its own copy of the failure, and
    its close raises that copy: after the CheckpointError already raised it is logged only."""
    try:
      self.manager.close()
    except Exception as e:  # pylint: disable=broad-exception-caught
      if not self._failure_reported:
        raise
      logging.info('orbax reports the failed save again on closing: %s',
                   saved_params.describe_error(e))


def saved_tree(state):
  """The train state as saved: its fields as a dict, without the moving average when there is
  none, so a run without one writes (and reads) checkpoints exactly as before it existed.
  Any other tree is saved as it is."""
  if not dataclasses.is_dataclass(state):
    return state
  fields = {field.name: getattr(state, field.name) for field in dataclasses.fields(state)}
  return {name: value for name, value in fields.items()
          if not (name == 'ema' and value is None)}


def _without_missing_ema(path: str, abstract_state, arrays: dict):
  """`abstract_state` without its moving average if the checkpoint holds none (one written
  with opt.ema_decay = 0): the restored state's `ema` is then None, and the training loop
  starts the average from the restored params."""
  if abstract_state.ema is None or any(key.startswith('ema/') for key in arrays):
    return abstract_state
  logging.info('Checkpoint %s holds no moving average of the weights (written with '
               'opt.ema_decay=0): starting it from the restored params.', path)
  return abstract_state.replace(ema=None)


def _drop_late_writer_callbacks() -> None:
  """After a failed save, the writes still in flight finish on tensorstore's threads and try to
  wake orbax's event loop, which has already been closed: each reports RuntimeError('Event loop
  is closed') as an unraisable exception (sys.unraisablehook: a bare traceback on stderr),
  dozens in all. They say nothing the failed save's error does not; drop exactly those, and
  pass every other report on."""
  previous = sys.unraisablehook
  if getattr(previous, 'drops_late_writer_callbacks', False):
    return

  def hook(unraisable):
    calls = [frame.f_code.co_name for frame, _ in
             traceback.walk_tb(unraisable.exc_traceback)]
    if (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) ==
        'Event loop is closed' and calls[-2:] == ['call_soon_threadsafe', '_check_closed']):
      return
    previous(unraisable)
  hook.drops_late_writer_callbacks = True
  sys.unraisablehook = hook


# Config compatibility on resume.

def _flatten(tree, prefix='') -> dict[str, Any]:
  if isinstance(tree, dict):
    out = {}
    for key, value in tree.items():
      out.update(_flatten(value, f'{prefix}{key}.'))
    return out
  return {prefix[:-1]: tree}


def config_differences(saved_json: str, config) -> dict[str, tuple[Any, Any]]:
  """{key: (saved value, current value)} for every key that differs."""
  saved = _flatten(as_asked(json.loads(saved_json)))
  current = _flatten(json.loads(config.to_json_best_effort()))
  return {key: (saved.get(key), current.get(key)) for key in sorted(set(saved) | set(current))
          if saved.get(key) != current.get(key)}


def _format(shape_dtype) -> str:
  return 'nothing' if shape_dtype is None else f'{shape_dtype[1].name}{list(shape_dtype[0])}'


def refuse_changes(path: str, saved_config_json: str, config) -> dict[str, tuple[Any, Any]]:
  """Raises ConfigError where `config` differs from the config saved with checkpoint `path` in
  what the run trains; returns the differences a resume may make ({key: (saved, current)})."""
  differences = config_differences(saved_config_json, config)
  refused = {k: v for k, v in differences.items() if not _may_change(k, v, config)}
  if refused:
    raise ConfigError(
        f'checkpoint {path} was saved with other settings of what the run trains (model, '
        'vocabulary, data, seed or schedule), which a resumed run cannot change: '
        + '; '.join(f'{k}: {o!r} -> {n!r}' for k, (o, n) in refused.items())
        + '. Rerun with the saved values, or start a new --workdir (--config.ckpt.init_from='
        f'{path} starts it from these parameters)')
  return differences


def check_compatible(path: str, saved_tree: dict, abstract_trees: tuple, saved_config_json: str,
                     config) -> None:
  """Refuses a checkpoint whose arrays the config cannot hold (CheckpointError), or whose
  config differs in what the run trains (ConfigError); logs the changes a resume may make.

  `abstract_trees` are the items saved side by side (train state, dropout key).
  """
  expected = {name: value for tree in abstract_trees for name, value in saved_params.array_shapes(tree).items()}
  mismatched = [f'{key}: saved {_format(saved_tree.get(key))}, config gives '
                f'{_format(expected.get(key))}'
                for key in sorted(set(saved_tree) | set(expected))
                if saved_tree.get(key) != expected.get(key)]
  if mismatched:
    listed = '; '.join(f'{key}: {old!r} -> {new!r}' for key, (old, new) in
                       config_differences(saved_config_json, config).items())
    raise CheckpointError(
        f'checkpoint {path} was written with a config whose arrays have other shapes or '
        f'dtypes than this config gives ({len(mismatched)} arrays, e.g. {mismatched[0]}). '
        f'Config keys that differ: {listed or "none"}. Rerun with the checkpoint\'s values '
        f'(saved in its "{CONFIG}" item and in the workdir\'s config.json), or use a new '
        '--workdir.')
  differences = refuse_changes(path, saved_config_json, config)
  if differences:
    logging.info('Resuming %s with changed settings: %s', path,
                 '; '.join(f'{k}: {o!r} -> {n!r}' for k, (o, n) in differences.items()))


def _may_change(key: str, values: tuple, config) -> bool:
  """Whether a resume may change config `key` from `values[0]` to `values[1]`."""
  if None in values:  # A key added or removed by another t2t_jax version.
    return True
  if key == 'train.num_steps':  # Sets where these schedules end, so their every step.
    return config.opt.schedule not in ('linear', 'cosine') and not config.opt.cooldown_steps
  return key.startswith(MAY_CHANGE)


# Params-only loading, averaging and writing.
