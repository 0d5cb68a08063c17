"""The training loop end to end on the tiny config, resume and NaN handling, a profile of chosen
steps (dry runs: test_dry_run.py)."""

import collections
import gc
import glob
import json
import logging
import math
import os
import shutil
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import adam_moments, assert_adam_runs_agree, leaves_equal, saved_state_field
from conftest import scalar_events, text_config
from t2t_jax import plot
from t2t_jax import sharding
from t2t_jax.data import pipeline
from t2t_jax.model import transformer as model_lib
from t2t_jax.training import metric_log
from t2t_jax.training import profiling
from t2t_jax.training import step as step_lib
from t2t_jax.training import task as task_lib
from t2t_jax.training import train


@pytest.mark.slow
def test_train_and_evaluate_writes_events_config_and_checkpoint(tiny_config, tiny_run, tmp_path):
  # The session's run of this config (conftest.py), copied: this test resumes it.
  workdir = str(shutil.copytree(tiny_run[0], tmp_path / 'run'))
  results = tiny_run[1]
  tmp_path = tmp_path / 'run'
  assert results['step'] == 20 and results['config'] == 'tiny'
  for key in ('eval_loss', 'eval_accuracy', 'bleu', 'exact_match'):
    assert np.isfinite(results[key])
  events = scalar_events(workdir)
  assert {'train/loss', 'train/learning_rate', 'train/model_flops_per_second', 'eval/loss',
          'bleu'} <= set(events)
  assert 'train/mfu' not in events  # No published peak for a CPU: no made-up MFU.
  assert results['model_flops_per_second'] > 0 and results['mfu'] is None
  json.dumps(results, allow_nan=False)
  assert json.load(open(tmp_path / 'config.json'))['model']['d_model'] == 32
  assert 'd_model: 32' in open(tmp_path / 'config.txt').read()
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['10', '20']

  tiny_config.unlock()
  tiny_config.train.num_steps = 25
  resumed = train.train_and_evaluate(tiny_config, workdir)
  assert resumed['step'] == 25
  saved = open(tmp_path / 'final.json').read()
  assert json.loads(saved) == json.loads(json.dumps(resumed))  # Strict JSON: no NaN token.
  # Launched again when finished: nothing trains; the saved figures, train_loss included.
  assert train.train_and_evaluate(tiny_config, workdir) == json.loads(saved)
  assert np.isfinite(json.loads(saved)['train_loss'])


@pytest.mark.slow
def test_a_task_handed_to_the_loop_is_what_it_trains_evaluates_and_reports_to(tiny_config,
                                                                             tiny_run, tmp_path):
  """The seam (training/task.py): a task and a reporter of the test's own, handed to the
  unchanged loop. Its objective is the model's with the loss multiplied by zero: every
  gradient is zero, so Adam (no weight decay in configs/tiny.py) leaves the weights as they
  were initialised, where the default task's run of the same config (tiny_run) moves them; the
  eval step computes it too (an eval loss of 0 beside the model's real perplexity). Its
  evaluator's figures reach the logs, TensorBoard and the results; the reporter stops the run
  at step 10, which is saved."""
  assert tiny_config.opt.weight_decay == 0.0 and not tiny_config.opt.ema_decay

  def untrainable(model, params, batch, label_smoothing, loss_chunk_tokens=0, **kwargs):
    sums = step_lib.model_metrics(model, params, batch, label_smoothing, loss_chunk_tokens,
                                  **kwargs)
    return dict(sums, loss=0.0 * sums['loss'])

  seen = []

  class Counter:
    """An evaluator: which parameters it was asked to judge, and a figure of its own."""

    def __init__(self, context: task_lib.EvalContext):
      assert context.workdir == str(tmp_path) and context.config.train.num_steps == 20
      self.calls = 0

    def __call__(self, params, step, primary):
      self.calls += 1
      seen.append((step, primary))
      return {'evaluations_so_far': float(self.calls)}

    def record(self, workdir, step):
      (tmp_path / f'recorded_{step}').write_text('')

  class StopAtTen:
    def decide(self, step, results, last):
      assert results['evaluations_so_far'] == step // 5 and not last
      return 'ten is enough' if step == 10 else None

    def record(self, workdir, step, why):
      (tmp_path / 'stopped').write_text(f'{step}: {why}')

  config = tiny_config
  config.train.eval_every = config.ckpt.every = 5
  task = task_lib.Task('untrainable', objective=untrainable, evaluators=(Counter,))
  with pytest.raises(task_lib.Pruned) as stopped:
    train.train_and_evaluate(config, str(tmp_path), reporters=(StopAtTen(),), task=task)
  assert stopped.value.step == 10 and (tmp_path / 'stopped').read_text() == '10: ten is enough'
  assert seen == [(5, True), (10, True)]
  assert sorted(p.name for p in tmp_path.glob('recorded_*')) == ['recorded_10', 'recorded_5']
  assert sorted(os.listdir(tmp_path / 'checkpoints')) == ['10', '5']
  events = scalar_events(tmp_path)
  assert events['evaluations_so_far'] == {5: 1.0, 10: 2.0}
  assert events['eval/loss'] == {5: 0.0, 10: 0.0} and events['eval/perplexity'][10] > 1.0
  assert 'bleu' not in events  # The default task's evaluator was not made.
  # Zero gradients: the weights of step 10 are those of step 5 (and of the start), bit for bit;
  # the default objective's run of the same config moved them between its saves.
  assert leaves_equal(saved_state_field(tmp_path / 'checkpoints' / '5'),
                      saved_state_field(tmp_path / 'checkpoints' / '10'))
  assert not leaves_equal(saved_state_field(f'{tiny_run[0]}/checkpoints/10'),
                          saved_state_field(f'{tiny_run[0]}/checkpoints/20'))


def test_metric_log_reports_model_flops_and_mfu(monkeypatch):
  clock = iter([0.0, 10.0, 10.0, 13.0, 13.0])  # Start, a 10 s interval, then a 3 s one.
  monkeypatch.setattr(metric_log.time, 'perf_counter', lambda: next(clock))
  written = {}
  writer = types.SimpleNamespace(add_scalar=lambda name, value, step: written.update(
      {(name, step): value}))
  log = metric_log.MetricLog(writer, lambda step: 1e-3, num_steps=10, start_step=0,
                         peak_flops_per_second=4e9)
  metrics = {'loss': np.float32(2.0), 'nll': np.float32(2.0), 'correct': np.float32(1.0),
             'weight': np.float32(4.0)}
  log.add(1, metrics, model_flops=5e9)  # The compiling interval: left out of the final figures.
  log.write(1)
  for step in (2, 3, 4):
    log.add(step, metrics, model_flops=2e9)
  log.write(4)
  assert written[('train/model_flops_per_second', 1)] == pytest.approx(5e8)
  assert written[('train/mfu', 1)] == pytest.approx(5e8 / 4e9)
  assert written[('train/model_flops_per_second', 4)] == pytest.approx(2e9)
  assert written[('train/mfu', 4)] == pytest.approx(0.5)
  final = log.final()
  assert final['model_flops_per_second'] == pytest.approx(2e9)
  assert final['mfu'] == pytest.approx(0.5) and final['steps_per_second'] == pytest.approx(1.0)


def test_metric_log_says_where_the_host_time_went(monkeypatch):
  clock = iter([0.0, 8.0, 8.0])  # Start, then an 8 s interval.
  monkeypatch.setattr(metric_log.time, 'perf_counter', lambda: next(clock))
  # The host clock runs, and jumps by what each wait below is said to take.
  jumps, real_monotonic = [0.0], metric_log.time.monotonic
  monkeypatch.setattr(metric_log.time, 'monotonic', lambda: real_monotonic() + jumps[0])
  real_device_get = metric_log.jax.device_get

  def slow_device_get(tree):  # The step that made the metrics takes 6 s to finish.
    jumps[0] += 6.0
    return real_device_get(tree)
  monkeypatch.setattr(metric_log.jax, 'device_get', slow_device_get)
  scalars = []
  writer = types.SimpleNamespace(add_scalar=lambda name, value, step: scalars.append(
      (name, value)))
  log = metric_log.MetricLog(writer, lambda step: 1e-3, num_steps=10, start_step=0,
                             peak_flops_per_second=None)
  try:
    metrics = {'loss': np.float32(2.0), 'nll': np.float32(2.0), 'correct': np.float32(1.0),
               'weight': np.float32(4.0)}
    with log.waiting('input'):
      jumps[0] += 0.4
    log.add(1, metrics, model_flops=1e9)
    with log.waiting('save_and_evaluation'):
      jumps[0] += 1.0
    gc.collect()  # A full collection: the oldest generation.
    written = log.write(1)
  finally:
    log.close()
  assert log._time_gc not in gc.callbacks
  assert not any(name.startswith('train/host_') for name, _ in scalars)  # Log line only.
  assert written['host_input_wait_share'] == pytest.approx(0.05, abs=1e-3)
  assert written['host_device_wait_share'] == pytest.approx(0.75, abs=1e-3)
  assert written['host_save_and_evaluation_wait_share'] == pytest.approx(0.125, abs=1e-3)
  assert written['host_gc_oldest_collections'] >= 1
  assert 0 < written['host_gc_seconds'] < 8
  with open('/proc/self/status') as f:  # Another reading of the same figure, in kB.
    rss_kib = next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))
  assert written['host_resident_gib'] == pytest.approx(rss_kib / 2**20, rel=0.1)


@pytest.mark.slow
def test_synthetic_loss_falls(tiny_config):
  tiny_config.opt.schedule = 'constant'
  tiny_config.opt.lr_scale = 3e-3
  tiny_config.model.dropout = 0.0
  task = pipeline.load(tiny_config, '')
  setup = train.build(tiny_config, task.vocab.vocab_size)
  batches = pipeline.TokenBudgetBatches(task.train, 256, [16], sharding.batch_shards(setup.mesh),
                                    shuffle=True, seed=0)
  iterator = pipeline.train_iterator(batches)
  state = setup.init(jax.random.PRNGKey(0))
  losses = []
  for _ in range(120):
    state, metrics = setup.train_step(state, sharding.global_batch(next(iterator), setup.mesh),
                                      jax.random.PRNGKey(1))
    losses.append(float(metrics['loss'] / metrics['weight']))
  # Copying needs attention: unigram statistics alone stay near the first losses.
  assert np.mean(losses[-10:]) < 0.6 * np.mean(losses[:10])


def _tensorboard_scalars(workdir) -> dict[str, list[int]]:
  """{tag: steps} as TensorBoard shows them: a SessionLog START at step S (a resumed launch)
  hides the values an earlier launch wrote at steps >= S."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  launches = [[event_pb2.Event.FromString(record) for record in plot._records(path)]
              for path in glob.glob(os.path.join(workdir, 'events.out.tfevents.*'))]
  steps = collections.defaultdict(list)
  for events in sorted(launches, key=lambda events: events[0].wall_time):
    for event in events:
      if event.session_log.status == event_pb2.SessionLog.START:
        steps = collections.defaultdict(list, {tag: [s for s in shown if s < event.step]
                                               for tag, shown in steps.items()})
      for value in event.summary.value:
        steps[value.tag].append(event.step)
  return steps


@pytest.mark.slow
def test_tensorboard_shows_each_step_once_after_a_resume(tiny_config, tiny_run, tmp_path):
  # The session's run (conftest.py), copied: its first launch logged steps 5 to 20.
  workdir = shutil.copytree(tiny_run[0], tmp_path / 'run')
  shutil.rmtree(workdir / 'checkpoints' / '20')  # As if killed before saving step 20.
  os.remove(workdir / 'final.json')
  train.train_and_evaluate(tiny_config, str(workdir))  # Resumes at 10, logs 15 and 20 again.
  steps = _tensorboard_scalars(workdir)
  assert steps['train/loss'] == [5, 10, 15, 20]
  assert all(len(shown) == len(set(shown)) for shown in steps.values()), steps


@pytest.mark.slow
def test_text_source_trains(tiny_config, tmp_path):
  config = text_config(tiny_config, tmp_path)
  config.train.num_steps = 4
  config.train.eval_every = 4
  config.ckpt.every = 0
  results = train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert results['step'] == 4 and 0 <= results['bleu'] <= 100
  # The vocabulary it trained is a real SentencePiece model of the asked size that gives every
  # training line back, read here with sentencepiece itself.
  import sentencepiece  # pylint: disable=g-import-not-at-top
  vocab = sentencepiece.SentencePieceProcessor(model_file=str(tmp_path / 'run' / 'vocab.model'))
  assert vocab.get_piece_size() == config.data.vocab_size == 40
  for path in (config.data.train_src, config.data.train_tgt):
    lines = open(path, encoding='utf-8').read().splitlines()
    assert [vocab.decode(vocab.encode(line)) for line in lines] == lines
  # Four updates already predict the held-out targets better than a uniform guess.
  assert results['eval_loss'] < math.log(config.data.vocab_size)


@pytest.mark.slow
def test_non_finite_loss_stops_with_the_step(tiny_config, tmp_path):
  tiny_config.opt.schedule = 'constant'
  tiny_config.opt.lr_scale = 1e30
  tiny_config.ckpt.every = 0
  with pytest.raises(FloatingPointError, match=r'training loss is (nan|inf) at step \d+'):
    train.train_and_evaluate(tiny_config, str(tmp_path))


def _traced(directory) -> tuple[set[int], set[str]]:
  """The steps annotated in the one trace under `directory`, and the programs it ran."""
  traces = glob.glob(os.path.join(directory, 'plugins', 'profile', '*', '*.xplane.pb'))
  assert len(traces) == 1, traces
  steps, programs = set(), set()
  for plane in jax.profiler.ProfileData.from_file(traces[0]).planes:
    for line in plane.lines:
      for event in line.events:
        stats = dict(event.stats)
        if event.name == 'train' and 'step_num' in stats:
          steps.add(stats['step_num'])
        if 'hlo_module' in stats:
          programs.add(stats['hlo_module'])
  return steps, programs


@pytest.mark.slow
def test_a_profile_of_chosen_steps_is_written_into_the_workdir(tiny_config, tmp_path, caplog):
  tiny_config.train.num_steps = 4
  tiny_config.train.eval_every = 4
  tiny_config.eval.bleu_sentences = 0
  tiny_config.train.profile_steps = (2, 3)
  with caplog.at_level(logging.INFO):
    train.train_and_evaluate(tiny_config, str(tmp_path))
  directory = str(tmp_path / 'profile')
  steps, programs = _traced(directory)
  assert steps == {2, 3}  # Each step annotated for the viewers' step views; none other.
  assert 'jit_train_step' in programs  # The compiled step's kernels, not only the host's calls.
  assert 'jit_eval_step' not in programs  # Step 4's evaluation came after the window.
  assert glob.glob(os.path.join(directory, 'plugins', 'profile', '*', 'perfetto_trace.json.gz'))
  said = [r.getMessage() for r in caplog.records if 'Profile of steps' in r.getMessage()]
  assert said == [f'Profile of steps 2 to 3 written to {directory} (docs/performance.md, '
                  '"A profile of chosen steps")']


def test_a_profile_is_written_where_the_run_ends_inside_its_window(tmp_path):
  @jax.jit
  def add_one(x):
    return x + 1

  x = jnp.zeros(())
  with pytest.raises(RuntimeError, match='stopped at step 3'):
    with profiling.window((2, 5), str(tmp_path)) as profile:
      for step in range(1, 6):
        profile.before(step)
        with profile.annotate(step):
          x = add_one(x)
        profile.after(step, x)
        if step == 3:
          raise RuntimeError('stopped at step 3')
  steps, programs = _traced(str(tmp_path))
  assert steps == {2, 3} and programs == {'jit_add_one'}
  with profiling.window((), str(tmp_path / 'off')) as profile:  # No window: no trace.
    profile.before(1)
    profile.after(1, x)
  assert not os.path.exists(tmp_path / 'off')


def test_bad_mesh_is_refused(tiny_config, tmp_path):
  tiny_config.mesh.shape = (3, -1, 1)
  with pytest.raises(ValueError, match=r'needs a multiple of 3 devices, but there are 8'):
    train.train_and_evaluate(tiny_config, str(tmp_path))


@pytest.fixture(scope='module')
def unrolled_steps():
  """Two steps of 2+2 unrolled layers under FSDP, the reference of both scanned variants
  below (built once: its compile and steps are the same for each): (config, setup, batch,
  [(params, opt_state, loss)] after each step)."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  config = tiny.get_config()
  config.model.num_encoder_layers = config.model.num_decoder_layers = 2
  config.model.dropout = config.model.attention_dropout = config.model.relu_dropout = 0.0
  config.mesh.shape = (2, 4, 1)  # FSDP: the stacked weights are split along 'embed' too.
  vocab_size = pipeline.vocab_size(config)
  unrolled = train.build(config, vocab_size)
  tokens = np.random.default_rng(0).integers(2, vocab_size, (16, 12)).astype(np.int32)
  tokens[8:, 7:] = 0
  batch = sharding.global_batch({'inputs': tokens, 'targets': tokens}, unrolled.mesh)
  state, history = unrolled.init(jax.random.PRNGKey(0)), []
  for _ in range(2):
    state, metrics = unrolled.train_step(state, batch, jax.random.PRNGKey(1))
    history.append(jax.device_get((state.params, state.opt_state, metrics['loss'])))
  return config, unrolled, batch, history


@pytest.mark.slow
@pytest.mark.parametrize('remat', ['none', 'dots'])
def test_scanned_rematerialised_steps_match_unrolled_steps(unrolled_steps, remat):
  config, unrolled, batch, history = unrolled_steps
  config = config.copy_and_resolve_references()
  config.model.scan_layers, config.model.remat = True, remat
  scanned = train.build(config, pipeline.vocab_size(config), unrolled.mesh)
  query = scanned.abstract_state.params['decoder_layers']['self_attention']['query']
  assert query.sharding.spec == jax.sharding.PartitionSpec(None, 'fsdp', 'tensor', None)

  stacked = model_lib.stack_layer_params(unrolled.init(jax.random.PRNGKey(0)).params,
                                         unrolled.model_config)
  scanned_state = jax.device_put(
      step_lib.TrainState(step=np.int32(0), params=stacked,
                       opt_state=scanned.optimizer.init(stacked)),
      jax.tree.map(lambda abstract: abstract.sharding, scanned.abstract_state))
  scanned_history = []
  for _, _, loss in history:
    scanned_state, scanned_metrics = scanned.train_step(scanned_state, batch,
                                                        jax.random.PRNGKey(1))
    np.testing.assert_allclose(scanned_metrics['loss'], loss, rtol=1e-5)
    # The scanned run's weights and Adam moments in the unrolled layout.
    unstack = lambda tree: model_lib.unstack_layer_params(jax.device_get(tree),
                                                          unrolled.model_config)
    mu, nu = adam_moments(scanned_state.opt_state)
    scanned_history.append((unstack(scanned_state.params),
                            optax.ScaleByAdamState(count=None, mu=unstack(mu), nu=unstack(nu))))
  # Same arithmetic, another program: within what rounding can do to Adam (conftest.py).
  assert_adam_runs_agree(scanned_history, [(params, opt_state) for params, opt_state, _ in
                                           history], [float(unrolled.schedule(t)) for t in (0, 1)])
