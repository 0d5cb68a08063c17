"""The training loop: mesh -> data -> init or restore -> steps -> evaluate -> save.

The step functions are in step.py, building and jitting them in setup.py, the dry run in
dry_run.py and the metric log in metric_log.py. `build`, `Setup` and `count_params` are
importable from here too, where the side-by-side benchmarks look for them.
"""

import dataclasses
import json
import os
import time
from typing import Any, Sequence

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import tensorboardX

from t2t_jax import CheckpointError
from t2t_jax import cli
from t2t_jax import runtime
from t2t_jax import sharding
from t2t_jax import workdir_layout
from t2t_jax import workdir_lock
from t2t_jax.checkpoints import checkpoint
from t2t_jax.checkpoints import partial_init
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import pipeline as data
from t2t_jax.model import flops
from t2t_jax.model import prng
from t2t_jax.training import lifecycle
from t2t_jax.training import metric_log
from t2t_jax.training import optim
from t2t_jax.training import profiling
from t2t_jax.training import resolve
from t2t_jax.training import task as task_lib
from t2t_jax.training import tasks
from t2t_jax.training.build import Setup, build, count_params  # pylint: disable=unused-import


def train_and_evaluate(config, workdir: str, force_unlock: bool = False,
                       reporters: Sequence[task_lib.Reporter] = (),
                       task: task_lib.Task | None = None) -> dict[str, Any]:
  """Trains `config` in `workdir` (resuming if it holds a checkpoint); returns final figures.

  `task`: what the run trains and how it is judged (task.py); None is the config's
  (tasks.for_config). `reporters` hear each in-loop evaluation's figures and may stop the run;
  a stopped run saves its step and raises task.Pruned.

  Process 0 holds the workdir's lock throughout: a second launch on it is refused, on every
  process, while this one lives (`force_unlock` takes the lock regardless). SIGTERM and Ctrl-C
  raise lifecycle.Preempted once the run has stopped (lifecycle.py says how, per phase).
  """
  runtime.start()  # Done already where a command called this; a library caller's first.
  task = task or tasks.for_config(config)
  if task.configure:
    task.configure(config)
  resolved = resolve.resolve(config)  # Every check, and every derived value, before any work.
  workdir_lock.make_workdir(workdir)
  with lifecycle.Lifecycle(config.ckpt.preemption_grace_seconds,
                           config.train.step_timeout_seconds) as life:
    try:
      with workdir_lock.hold(workdir, force_unlock):
        return _train_and_evaluate(config, resolved, workdir, life, task, tuple(reporters))
    except lifecycle.Interrupted:  # Start-up, or the final evaluation of a resumed run.
      raise life.stopped(None, workdir_layout.checkpoints_dir(workdir)) from None


@dataclasses.dataclass
class _Launch:
  """One launch of the loop on a workdir: what it built, restored and writes to."""
  config: Any
  workdir: str
  setup: Setup
  splits: data.TaskData
  eval_batches: Any
  train_iter: Any
  state: Any  # step.TrainState
  dropout_rng: jax.Array
  resumed: bool
  checkpointer: checkpoint.Checkpointer
  evaluators: list  # task.Evaluator, made for this launch.
  writer: Any  # tensorboardX.SummaryWriter, or metric_log.NullWriter off process 0.
  config_json: str
  pruned: str | None = None  # Why a reporter stopped the run (task.py).


def _train_and_evaluate(config, resolved: resolve.Resolved, workdir: str,
                        life: lifecycle.Lifecycle, task: task_lib.Task,
                        reporters: tuple) -> dict[str, Any]:
  with life.phase(lifecycle.STARTUP):
    launch = _start(config, resolved, workdir, task)
  life.remove_unfinished = launch.checkpointer.remove_unfinished
  start_step, train_start = int(launch.state.step), time.perf_counter()
  log = metric_log.MetricLog(launch.writer, launch.setup.schedule, config.train.num_steps,
                             start_step, flops.devices_peak_flops_per_second(
                                 list(launch.setup.mesh.devices.flat),
                                 launch.setup.model_config.dtype))
  logging.info('Training from step %d to %d', start_step, config.train.num_steps)
  try:
    results, preempted = _train(launch, log, life, reporters)
  except Exception:  # NaN loss, full disk, ...: the save in flight (of a good step) finishes.
    _close_after_error(launch.checkpointer)
    raise
  finally:
    log.close()
  step = int(launch.state.step)
  if preempted or launch.pruned:  # Stopped early: the save of its last step finishes.
    with life.phase(lifecycle.SAVE, step):
      launch.checkpointer.close()
    launch.writer.close()
    if preempted:
      raise life.stopped(step, launch.checkpointer.directory)
    if jax.process_index() == 0:
      for reporter in reporters:
        reporter.record(workdir, step, launch.pruned)
    raise task_lib.Pruned(step, launch.pruned)
  saved = _read_final(workdir, step) if not results else None
  if not results and not saved:  # Resumed at the end, figures unsaved: evaluate again.
    with life.phase(lifecycle.FINAL_EVALUATION, step):
      results = evaluate_state(launch.setup, launch.state, launch.eval_batches, config,
                               launch.evaluators, step)
  with life.phase(lifecycle.SAVE, step):
    launch.checkpointer.close()
  launch.writer.close()
  if saved:  # Resumed a finished run: nothing trained; report what it reported.
    logging.info('The run had already finished at step %d; its final figures follow.',
                 saved['step'])
    return saved
  figures = {'config': config.name, 'step': int(launch.state.step), **results, **log.final(),
             'train_seconds': round(time.perf_counter() - train_start, 1)}
  if jax.process_index() == 0:  # Sweep summaries and a resumed finished run read it back.
    with life.phase(lifecycle.FINAL_EVALUATION, step), open(
        os.path.join(workdir, workdir_layout.FINAL_JSON), 'w') as f:
      f.write(cli.json_line(figures) + '\n')
  return figures


def _close_after_error(checkpointer: checkpoint.Checkpointer) -> None:
  """Lets the save in flight finish while another error stops the run; its own failure is
  logged, as the error already on its way says why the run stopped."""
  try:
    checkpointer.close()
  except CheckpointError as e:
    logging.warning('%s', e)


def _start(config, resolved: resolve.Resolved, workdir: str, task: task_lib.Task) -> _Launch:
  """Mesh, data and jitted functions; the state restored from the workdir or initialised."""
  mesh = sharding.make_mesh(config.mesh)
  checkpointer = checkpoint.Checkpointer(workdir, config.ckpt)
  saved = checkpointer.latest_config()
  if saved:  # A resume: refused before any work if it cannot go on as the run saved it.
    checkpoint.refuse_changes(*saved, config)
    resolved = resolve.for_saved_run(config, resolved, saved[1], saved[0])
  splits = _load_data(config, workdir)
  train_batches, eval_batches = _batchers(config, splits, resolved)
  setup = build(config, data.vocab_size(config), mesh, task.objective)
  logging.info('Model: %d parameters; mesh %s; %d train / %d eval pairs; %d batches per epoch',
               count_params(setup.abstract_state.params), dict(mesh.shape), len(splits.train),
               len(splits.eval), len(train_batches))
  init_rng, dropout_rng = jax.random.split(jax.random.PRNGKey(config.seed))
  dropout_rng = prng.dropout_key(dropout_rng, config.model.dropout_prng)
  train_iter = data.train_iterator(train_batches)
  restored = checkpointer.restore(setup.abstract_state, config, dropout_rng.shape)
  if restored:
    resolve.check_resume(restored.config_json, config, resolved,
                         os.path.join(checkpointer.directory, str(restored.step)))
    state, dropout_rng = restored.state, restored.rng
    if state.ema is None and setup.abstract_state.ema is not None:  # Saved without one.
      state = state.replace(ema=_ema_start(setup, state.params))
    train_iter.set_state(restored.data_state)
  else:
    state = setup.init(init_rng)
    if config.ckpt.init_from:  # Fine-tune from averaged, exported or other run's params.
      params = partial_init.init_params(
          saved_params.checkpoint_path(workdir, config.ckpt.init_from), config, state.params,
          setup.abstract_state.params, getattr(splits.vocab, 'path', None))
      state = state.replace(params=params, ema=None if state.ema is None else
                            _ema_start(setup, params))
  config_json = _write_config(config, resolved, workdir)
  # A resumed run logs again the steps after its checkpoint: TensorBoard drops the earlier
  # launch's values from purge_step on, so each step shows once.
  writer = (tensorboardX.SummaryWriter(workdir, purge_step=int(state.step) + 1 if restored
                                       else None)
            if jax.process_index() == 0 else metric_log.NullWriter())
  context = task_lib.EvalContext(config, setup, splits, workdir, resolved.eval_dtype)
  return _Launch(config, workdir, setup, splits, eval_batches, train_iter, state, dropout_rng,
                 bool(restored), checkpointer, [make(context) for make in task.evaluators],
                 writer, config_json)


def _train(launch: _Launch, log: metric_log.MetricLog, life: lifecycle.Lifecycle,
           reporters: tuple = ()) -> tuple[dict, bool]:
  """Steps from the state's step to config.train.num_steps, saving and evaluating on the way.

  Returns the last evaluation's figures and whether a signal (SIGTERM, Ctrl-C) stopped the loop
  after saving the step it arrived in. `launch.state` follows the steps. Each evaluation's
  figures go to the `reporters` (task.py); where one stops the run, the step is saved and
  `launch.pruned` says why. The steps config.train.profile_steps names are traced
  (profiling.py).
  """
  config, setup = launch.config, launch.setup
  num_steps, results, pending, seen_shapes = config.train.num_steps, {}, None, set()
  preempted = False
  with profiling.window(config.train.profile_steps,
                        workdir_layout.profile_dir(launch.workdir)) as profile:
    for step in range(int(launch.state.step) + 1, num_steps + 1):
      profile.before(step)
      with life.phase(lifecycle.STEP, step):
        with profile.annotate(step):
          with log.waiting('input'):
            host_batch = next(launch.train_iter)
          if host_batch['targets'].shape not in seen_shapes:  # Compiles the step: not guarded.
            seen_shapes.add(host_batch['targets'].shape)
            life.disarm()
          launch.state, metrics = setup.train_step(
              launch.state, sharding.global_batch(host_batch, setup.mesh), launch.dropout_rng)
        profile.after(step, (launch.state, metrics))  # The step's annotation ended: traced.
        launch.checkpointer.check()  # A save that failed in the background stops the run here.
        if pending:  # Read the previous step's metrics only now, so the device never waits.
          log.add(*pending)
        pending = (step, metrics, metric_log.step_flops(setup.model_config, host_batch))
        is_last, preempted = step == num_steps, life.requested(step)
        evaluate_now = is_last or step % config.train.eval_every == 0
        save_now = is_last or preempted or launch.checkpointer.should_save(step)
        if is_last or evaluate_now or save_now or step % config.train.log_every == 0:
          log.add(*pending)  # A NaN loss stops the run here, before its step is saved.
          pending = None
          log.write(step)
      with log.waiting('save_and_evaluation'):
        if save_now:
          _save(launch, life, step)
        if evaluate_now and not preempted:
          try:
            results = _evaluate(launch, life, step, save_now)
          except lifecycle.Interrupted as signal_name:
            logging.warning('%s during %s: evaluation abandoned, saving step %d',
                            signal_name, life.where(), step)
            preempted = True
            if not save_now:
              _save(launch, life, step)
        if evaluate_now and not preempted:
          launch.pruned = task_lib.first_stop(reporters, step, results, is_last)
          if launch.pruned and not save_now:
            _save(launch, life, step)
      if preempted or launch.pruned:
        break
  return results, preempted


def _save(launch: _Launch, life: lifecycle.Lifecycle, step: int) -> None:
  with life.phase(lifecycle.SAVE, step):
    launch.checkpointer.save(step, launch.state, launch.dropout_rng,
                             launch.train_iter.get_state(), launch.config_json)


def _evaluate(launch: _Launch, life: lifecycle.Lifecycle, step: int, saved_now: bool
              ) -> dict[str, float]:
  """The in-loop evaluation at `step` (the final one at the last step), of the params, their
  moving average (if kept) and (if asked) the average of the latest checkpoints. The
  evaluations are an interruptible phase (a signal abandons them); reading the checkpoints to
  average is not."""
  config, setup = launch.config, launch.setup
  phase = (lifecycle.FINAL_EVALUATION if step == config.train.num_steps else
           lifecycle.EVALUATION)
  with life.phase(phase, step):
    logging.info('step %d: evaluating', step)
    results = evaluate_state(setup, launch.state, launch.eval_batches, config,
                             launch.evaluators, step)
  if jax.process_index() == 0:  # File writes: not abandoned half-way by a signal.
    for evaluator in launch.evaluators:
      evaluator.record(launch.workdir, step)
  if config.eval.average_last and saved_now:
    averaged, steps = launch.checkpointer.average_last(config.eval.average_last,
                                                       setup.abstract_state.params)
    with life.phase(phase, step):
      averaged_results = run_evaluation(setup, averaged, launch.eval_batches, config,
                                        launch.evaluators, step, primary=False)
    results.update({f'averaged_{name}': value for name, value in averaged_results.items()})
    logging.info('Averaged checkpoints %s', steps)
  for name, value in results.items():
    launch.writer.add_scalar(name.replace('eval_', 'eval/'), value, step)
  logging.info('step %d eval: %s', step, json.dumps(results))
  return results


def _batchers(config, splits: data.TaskData, resolved: resolve.Resolved) -> tuple:
  """(train, eval) batch plans; this process collates only its rows of each global batch."""
  if not len(splits.train):
    raise data.DataError('no training pairs are left after reading and filtering the data')
  return data.make_batchers(config, splits.train, splits.eval, resolved.batch_shards,
                            jax.process_index(), jax.process_count(),
                            resolved.train_row_multiple)


def _load_data(config, workdir: str) -> data.TaskData:
  """Process 0 trains the vocabulary and fills the token cache (a shared folder); then all load."""
  if jax.process_count() == 1:
    return data.load(config, workdir)
  task = data.load(config, workdir) if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices('t2t_jax: vocabulary and token cache ready')
  return task or data.load(config, workdir)


def _write_config(config, resolved: resolve.Resolved, workdir: str) -> str:
  """Writes the config as text, and as JSON with what it resolved to; returns the JSON."""
  config_json = resolve.config_json(config, resolved)
  if jax.process_index() == 0:
    with open(os.path.join(workdir, workdir_layout.CONFIG_TEXT), 'w') as f:
      f.write(f'{config}\n# resolved for these devices (config.json has both):\n'
              + ''.join(f'# {key}: {value}\n' for key, value in resolved.as_dict().items()))
    with open(os.path.join(workdir, workdir_layout.CONFIG_JSON), 'w') as f:
      f.write(config_json)
  return config_json


def _ema_start(setup: Setup, params):
  """The moving average started at `params`, laid out as the train state keeps it."""
  return jax.device_put(optim.ema_init(params),
                        jax.tree.map(lambda a: a.sharding, setup.abstract_state.ema))


def evaluate_state(setup: Setup, state, eval_batches, config, evaluators, step: int
                   ) -> dict[str, float]:
  """`run_evaluation` of the params and, if the state keeps one, of their moving average,
  whose figures are named with an 'ema_' prefix (ema_eval_loss, ema_bleu, ...).

  The average is evaluated in the params' dtype (config.model.param_dtype), as translate
  --weights=ema reads it.
  """
  results = run_evaluation(setup, state.params, eval_batches, config, evaluators, step)
  if state.ema is not None:
    # Laid out as the params (mesh.shard_update splits the average over 'data' too).
    ema = jax.tree.map(lambda e, p: jax.device_put(e, p.sharding).astype(p.dtype), state.ema,
                       state.params)
    ema_results = run_evaluation(setup, ema, eval_batches, config, evaluators, step,
                                 primary=False)
    results.update({f'ema_{name}': value for name, value in ema_results.items()})
  return results


def run_evaluation(setup: Setup, params, eval_batches, config, evaluators, step: int,
                   primary: bool = True) -> dict[str, float]:
  """The objective's eval figures (loss, accuracy, perplexity) on the eval set, then each
  evaluator's at `step` (a translation run's: BLEU and exact match of the sentences due);
  `primary`: the run's own params."""
  sums = None
  for batch in data.eval_batches(eval_batches, config.eval.num_batches):
    metrics = jax.device_get(setup.eval_step(params, sharding.global_batch(batch, setup.mesh)))
    sums = metrics if sums is None else jax.tree.map(np.add, sums, metrics)
  if sums is None:
    logging.warning('The eval set is empty: no eval figures.')
    return {}
  results = {f'eval_{k}': v for k, v in optim.summarize(sums).items()}
  for evaluator in evaluators:
    results.update(evaluator(params, step, primary))
  return results


def _read_final(workdir: str, step: int) -> dict[str, Any] | None:
  """The figures a finished run saved at `step`, or None (none saved, or of another step)."""
  saved = workdir_layout.read_final(workdir)
  return saved if saved and saved.get('step') == step else None
