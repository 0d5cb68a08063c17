"""configs/multi30k.py (both variants, its data folder as a config value) and the plot command."""

import json
import math
import os
import re
import subprocess
import sys
import time
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorboardX

from conftest import ROOT, assert_drawn, scalar_events, write_lines
from configs import base as configs_base
from configs import multi30k
from t2t_jax import plot
from t2t_jax.checkpoints import saved_params
from t2t_jax.data import sources
from t2t_jax.decoding import translator as translator_lib
from t2t_jax.model import transformer as model_lib
from t2t_jax.training import optim
from t2t_jax.training import train

ENGLISH = ['a', 'dog', 'cat', 'runs', 'sleeps', 'on', 'the', 'grass', 'red', 'ball']
GERMAN = ['ein', 'Hund', 'Katze', 'rennt', 'schläft', 'auf', 'dem', 'Gras', 'roter', 'Ball']


def _fake_multi30k(root, count=120):
  """The folder layout of ../shared/data/multi30k, filled with a toy word-for-word language.

  The raw files are cased and the tok files lowercased, so which ones a run read shows in its
  vocabulary.
  """
  rng = np.random.default_rng(0)
  picks = [rng.integers(0, len(ENGLISH), rng.integers(2, 6)) for _ in range(count)]
  english = [' '.join(ENGLISH[i] for i in p) + ' .' for p in picks]
  german = [' '.join(GERMAN[i] for i in p) + ' .' for p in picks]
  os.makedirs(root / 'tok')
  for split, rows in (('train', slice(None)), ('valid', slice(0, 16))):
    write_lines(root / f'{split}.en', english[rows])
    write_lines(root / f'{split}.de', german[rows])
    write_lines(root / 'tok' / f'{split}.lc.norm.tok.en', [s.lower() for s in english[rows]])
    write_lines(root / 'tok' / f'{split}.lc.norm.tok.de', [s.lower() for s in german[rows]])
  return root


def _shrunk(variant, data_dir):
  config = multi30k.get_config(variant)
  config.data.data_dir = str(data_dir)
  config.data.vocab_size = 48
  config.data.batch_tokens = 512  # One 64-token packed row per data shard of the 8-device mesh.
  config.model.d_model = 32
  config.model.d_ff = 64
  config.model.num_heads = 2
  config.model.num_encoder_layers = 1
  config.model.num_decoder_layers = 1
  config.train.num_steps = 6
  config.train.log_every = 2
  config.train.eval_every = 3
  config.eval.bleu_every = 1
  config.ckpt.every = 3
  return config


def test_the_variants_follow_the_published_recipe():
  config = multi30k.get_config('tok')
  model = config.model
  assert (model.num_encoder_layers, model.num_decoder_layers, model.d_model, model.d_ff,
          model.num_heads, model.dropout) == (4, 4, 128, 256, 4, 0.3)
  assert model.share_embeddings and config.train.num_steps == 8000 and config.ckpt.keep == 10
  assert config.data.train_src == 'tok/train.lc.norm.tok.en'
  assert config.eval.bleu_tokenize == 'none'
  raw = multi30k.get_config('raw')
  assert (raw.data.eval_src, raw.data.eval_tgt) == ('valid.en', 'valid.de')
  assert raw.eval.bleu_tokenize == '13a'
  for name in ('train_src', 'train_tgt', 'eval_src', 'eval_tgt'):
    assert 'test' not in config.data[name] and 'test' not in raw.data[name]
  with pytest.raises(ValueError, match='multi30k.py:cased.*must be one of'):
    multi30k.get_config('cased')


def test_relative_paths_are_read_from_the_data_dir(tmp_path):
  _fake_multi30k(tmp_path, count=20)
  config = multi30k.get_config('tok').data
  config.data_dir = str(tmp_path)
  assert sources.open_split(config, 'eval').name == (
      f'{tmp_path}/tok/valid.lc.norm.tok.en / {tmp_path}/tok/valid.lc.norm.tok.de')
  # Absolute paths ignore the data folder.
  config.eval_src, config.eval_tgt = str(tmp_path / 'valid.en'), str(tmp_path / 'valid.de')
  config.data_dir = '/elsewhere'
  assert sources.open_split(config, 'eval').name == f'{tmp_path}/valid.en / {tmp_path}/valid.de'
  config.data_dir = str(tmp_path / 'missing')
  with pytest.raises(sources.DataError, match='missing/tok/train.lc.norm.tok.en'):
    sources.open_split(config, 'train')


@pytest.fixture(scope='module')
def member_runs(tmp_path_factory):
  """run(variant): the shrunk `variant` trained once per module (its family test and, for the
  data variants' test, the same run): (workdir, config, final figures)."""
  runs = {}

  def run(variant):
    if variant not in runs:
      directory = tmp_path_factory.mktemp(variant)
      config = _shrunk(variant, _fake_multi30k(directory / 'multi30k'))
      # Both kinds per stack where the layers alternate (local and compressed attention, dense
      # and MoE feed-forward); one layer of predictive positions is still above a uniform
      # guess's loss after six updates.
      config.model.num_encoder_layers = config.model.num_decoder_layers = 2
      workdir = directory / 'run'
      runs[variant] = workdir, config, train.train_and_evaluate(config, str(workdir))
    return runs[variant]
  return run


# Each data variant's run is one of the family test's: the member changes the model, not which
# files are read or how BLEU is scored.
@pytest.mark.slow
@pytest.mark.parametrize('variant, files, tokenize, cased', [
    ('predictive', 'tok', 'none', False), ('raw_relative', 'raw', '13a', True)])
def test_each_variant_trains_on_its_files_and_scores_its_bleu(member_runs, tmp_path, variant,
                                                              files, tokenize, cased):
  workdir, config, results = member_runs(variant)
  assert config.data.train_src == multi30k.get_config(files).data.train_src
  assert results['step'] == 6 and 0 <= results['bleu'] <= 100
  best = json.load(open(workdir / 'best_bleu.json'))
  assert f'tok:{tokenize}' in best['signature'] and 'case:mixed' in best['signature']
  assert best['label'] == ('tokenised BLEU' if tokenize == 'none' else 'sacreBLEU')
  from t2t_jax.data import tokenizer  # pylint: disable=g-import-not-at-top
  vocab = tokenizer.SentencePieceVocabulary(str(workdir / 'vocab.model'))
  pieces = {vocab.piece(i) for i in range(vocab.vocab_size)}
  assert any(any(c.isupper() for c in piece) for piece in pieces) == cased

  # The event files of that run draw into a PNG (the plot command's own path through the
  # command line is test_plot_command_prints_the_time_to_target_and_ends_with_a_json_line's).
  scalars = plot.read_scalars(str(workdir))
  lines, _ = plot.summary(scalars, str(workdir), 41)
  assert any(line.startswith('bleu: last') for line in lines), lines
  plot.draw(scalars, str(tmp_path / 'curves.png'), 'run', 41)
  assert_drawn(tmp_path / 'curves.png')

  # Without --src/--ref, evaluate scores the run's own validation files, and prints the BLEU
  # its config asks for: the figure training logged for the same (latest) parameters.
  completed = subprocess.run(
      [sys.executable, '-m', 't2t_jax.evaluate', f'--workdir={workdir}', '--beam_size=1'],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert completed.returncode == 0, completed.stderr
  printed = completed.stdout.strip().splitlines()
  valid = 'tok/valid.lc.norm.tok.en' if files == 'tok' else 'valid.en'
  assert printed[0].startswith(f'16 sentences of {workdir.parent}/multi30k/{valid}, '
                               'checkpoint latest')
  logged = scalar_events(workdir)['bleu'][6]
  if files == 'tok':
    assert len(printed) == 4 and 'as configured' in printed[3] and 'tok:none' in printed[3]
    figure = printed[3]
  else:  # 13a is the primary sacreBLEU line already.
    assert len(printed) == 3 and printed[1].startswith('sacreBLEU ')
    figure = printed[1]
  score = float(re.search(r' (\d+\.\d\d) \(nrefs:', figure).group(1))
  assert score == pytest.approx(logged, abs=0.01)


def test_read_scalars_joins_launches_and_keeps_the_last_value_of_a_repeated_step(tmp_path):
  start = time.time()
  first = tensorboardX.SummaryWriter(str(tmp_path), filename_suffix='.first')
  for step in (1, 2, 3):
    first.add_scalar('train/loss', 10.0 - step, step, walltime=start + 100 * step)
  first.close()
  second = tensorboardX.SummaryWriter(str(tmp_path), filename_suffix='.second')
  for step in (3, 4):  # A resume repeats the steps after its last checkpoint.
    second.add_scalar('train/loss', 20.0 + step, step, walltime=start + 10_000 + 50 * step)
  second.close()

  series = plot.read_scalars(str(tmp_path))['train/loss']
  assert series.steps == [1, 2, 3, 4]
  assert series.values == [9.0, 8.0, 23.0, 24.0]
  first_open, second_open = (_opened_at(tmp_path, suffix) for suffix in ('.first', '.second'))
  first_span = start + 300 - first_open
  np.testing.assert_allclose(series.seconds[:2], [start + 100 - first_open,
                                                  start + 200 - first_open], atol=1e-3)
  # The second launch continues where the first ended; the 10,000 s gap is not counted.
  np.testing.assert_allclose(series.seconds[2:], [first_span + start + 10_150 - second_open,
                                                  first_span + start + 10_200 - second_open],
                             atol=1e-3)


def _writer_opened_at(directory, suffix, wall_time):
  """A SummaryWriter whose opening (file_version) event carries `wall_time`."""
  with mock.patch('time.time', return_value=wall_time):
    return tensorboardX.SummaryWriter(str(directory), filename_suffix=suffix)


def _resumed_bleu_run(directory):
  """Event files of a run stopped after step 3000 for a day and resumed from it.

  Returns {step: training seconds} of the BLEU points, counted by hand from the written wall
  times (2,000 s in the first launch, then the second launch's time since it opened), and the
  run's total training seconds.
  """
  start = 1.7e9
  first = _writer_opened_at(directory, '.first', start)
  for step, value in ((1000, 30.0), (2000, 38.0), (3000, 40.0)):
    first.add_scalar('bleu', value, step, walltime=start + 0.6 * step)
    first.add_scalar('averaged_bleu', value - 5, step, walltime=start + 0.6 * step + 1)
  first.add_scalar('train/loss', 2.0, 3100, walltime=start + 2000)  # The launch's last event.
  first.close()
  resumed = start + 90_000  # Stopped for 88,000 s, which are not training time.
  second = _writer_opened_at(directory, '.second', resumed)
  # The resume repeats step 3000, now scoring 40.5; 41 is first reached at step 4000.
  for step, value in ((3000, 40.5), (4000, 41.0), (5000, 42.0)):
    second.add_scalar('bleu', value, step, walltime=resumed + 0.5 * step - 1000)
    second.add_scalar('averaged_bleu', value - 5, step, walltime=resumed + 0.5 * step - 999)
  second.close()
  seconds = {1000: 600.0, 2000: 1200.0, 3000: 2500.0, 4000: 3000.0, 5000: 3500.0}
  return seconds, 3501.0


@pytest.mark.parametrize('target, step, value', [
    (30.0, 1000, 30.0),  # Exactly equal counts as reached, in the first launch.
    (35.0, 2000, 38.0),
    (40.5, 3000, 40.5),  # The repeated step keeps the resumed launch's value and time.
    (41.0, 4000, 41.0),  # Reached only in the second launch.
    (41.5, 5000, 42.0)])
def test_time_to_target_is_the_first_point_at_or_above_it_in_joined_training_time(
    tmp_path, target, step, value):
  seconds, _ = _resumed_bleu_run(tmp_path)
  reached = plot.time_to_target(plot.read_scalars(str(tmp_path))['bleu'], target)
  assert (reached['step'], reached['value']) == (step, value)
  assert reached['seconds'] == pytest.approx(seconds[step], abs=1e-3)
  assert reached['minutes'] == pytest.approx(seconds[step] / 60, abs=1e-4)


def test_summary_reports_the_target_or_why_not_and_every_null_has_a_reason(tmp_path):
  seconds, total = _resumed_bleu_run(tmp_path)
  scalars = plot.read_scalars(str(tmp_path))
  lines, record = plot.summary(scalars, str(tmp_path), 41)
  assert record['bleu_target'] == 41
  assert record['training_minutes'] == pytest.approx(total / 60, abs=0.006)
  assert record['bleu'] == {'last': 42.0, 'last_step': 5000, 'best': 42.0, 'best_step': 5000,
                            'best_minutes': pytest.approx(seconds[5000] / 60, abs=0.006),
                            'minutes_to_target': pytest.approx(seconds[4000] / 60, abs=0.006),
                            'step_to_target': 4000}
  averaged = record['averaged_bleu']  # At most 37: never reached.
  assert (averaged['best'], averaged['best_step']) == (37.0, 5000)
  assert averaged['minutes_to_target'] is None and averaged['step_to_target'] is None
  assert set(record['null_reasons']) == {'averaged_bleu.minutes_to_target',
                                         'averaged_bleu.step_to_target'}
  assert record['null_reasons']['averaged_bleu.step_to_target'].startswith(
      'never reached 41 (best 37.00 at step 5000')
  assert f'bleu: first reached 41 at step 4000 after {seconds[4000] / 60:.1f} training ' \
         'minutes (41.00)' in lines
  assert any(line.startswith('averaged_bleu: never reached 41 (best 37.00') for line in lines)
  assert plot.time_to_target(scalars['averaged_bleu'], 41) is None

  _, record = plot.summary(scalars, str(tmp_path))  # No target: nulls, each with its reason.
  assert record['bleu_target'] is None and record['bleu']['minutes_to_target'] is None
  assert set(record['null_reasons']) == {'bleu_target'} | {
      f'{tag}.{key}' for tag in ('bleu', 'averaged_bleu')
      for key in ('minutes_to_target', 'step_to_target')}


def test_summary_gives_the_update_rate_spread_without_the_compiling_interval(tmp_path):
  writer = tensorboardX.SummaryWriter(str(tmp_path))
  rates = [0.4, 2.7, 2.6, 2.0, 2.9, 2.5]  # The first interval compiled.
  for i, rate in enumerate(rates):
    writer.add_scalar('train/steps_per_second', rate, 100 * (i + 1))
    writer.add_scalar('train/loss', 3.0 - i / 10, 100 * (i + 1))
  writer.close()
  scalars = plot.read_scalars(str(tmp_path))
  lines, record = plot.summary(scalars, str(tmp_path))
  assert record['steps_per_second'] == {'median': 2.6, 'min': 2.0, 'max': 2.9, 'intervals': 5}
  assert ('updates/s per log interval (the first left out): median 2.60, 2.00 to 2.90 over 5 '
          'intervals') in lines
  plot.draw(scalars, str(tmp_path / 'curves.png'))
  assert_drawn(tmp_path / 'curves.png')


@pytest.mark.slow
def test_plot_command_prints_the_time_to_target_and_ends_with_a_json_line(tmp_path):
  seconds, _ = _resumed_bleu_run(tmp_path / 'run')
  completed = subprocess.run(
      [sys.executable, '-m', 't2t_jax.plot', f'--workdir={tmp_path / "run"}',
       f'--output={tmp_path / "curves.png"}', '--bleu_target=41'],
      cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert completed.returncode == 0, completed.stderr
  printed = completed.stdout.strip().splitlines()
  assert (f'bleu: first reached 41 at step 4000 after {seconds[4000] / 60:.1f} training '
          'minutes (41.00)') in printed
  assert any(line.startswith('averaged_bleu: never reached 41') for line in printed)
  record = json.loads(printed[-1])
  assert record['workdir'] == str(tmp_path / 'run') and record['bleu_target'] == 41
  assert record['bleu']['step_to_target'] == 4000
  assert record['bleu']['minutes_to_target'] == pytest.approx(seconds[4000] / 60, abs=0.006)
  assert record['averaged_bleu']['step_to_target'] is None
  assert 'averaged_bleu.step_to_target' in record['null_reasons']
  assert_drawn(tmp_path / 'curves.png')


def _opened_at(directory, suffix):
  """Wall time of the first (file_version) event of the event file ending in `suffix`."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  [name] = [n for n in os.listdir(directory) if n.endswith(suffix)]
  first = next(plot._records(os.path.join(directory, name)))  # pylint: disable=protected-access
  return event_pb2.Event.FromString(first).wall_time


@pytest.mark.slow
def test_read_scalars_stops_at_a_torn_record_and_the_cli_explains_an_empty_workdir(tmp_path):
  writer = tensorboardX.SummaryWriter(str(tmp_path))
  for step in range(1, 4):
    writer.add_scalar('eval/loss', float(step), step)
  writer.close()
  [name] = os.listdir(tmp_path)
  with open(tmp_path / name, 'ab') as f:
    f.write(b'\x40\x00\x00\x00\x00\x00\x00\x00' + b'\x00' * 10)  # A record still being written.
  assert plot.read_scalars(str(tmp_path))['eval/loss'].values == [1.0, 2.0, 3.0]

  with pytest.raises(FileNotFoundError, match='no TensorBoard event files'):
    plot.read_scalars(str(tmp_path / 'nothing'))
  completed = subprocess.run([sys.executable, '-m', 't2t_jax.plot',
                              f'--workdir={tmp_path / "nothing"}'], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
  assert completed.returncode == 2 and 'error: no TensorBoard event files' in completed.stderr


@pytest.mark.slow
@pytest.mark.parametrize('variant, key, value', [
    ('raw_relative', 'positions', 'relative'), ('predictive', 'positions', 'predictive'),
    ('local_compressed', 'attention_pattern', 'local,compressed'), ('raw_moe', 'moe_experts', 4)])
def test_each_model_family_variant_trains_and_evaluates(member_runs, variant, key, value):
  workdir, config, results = member_runs(variant)
  assert config.name == 'multi30k_' + (variant if variant.startswith('raw_') else f'tok_{variant}')
  assert results['step'] == 6 and 0 <= results['bleu'] <= 100
  assert json.load(open(workdir / 'config.json'))['model'][key] == value
  # Six updates already predict the held-out targets better than a uniform guess.
  assert results['eval_loss'] < math.log(config.data.vocab_size)
  # What was trained and saved is the member's model, which is not the paper's.
  saved = {path: shape for path, (shape, _) in saved_params.saved_shapes(
      str(workdir / 'checkpoints' / '6' / 'state')).items() if 'params' in path}

  def param_shapes(model_section):
    model_config = model_lib.TransformerConfig.from_config(model_section,
                                                           config.data.vocab_size, 'cpu')
    tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    tree = jax.eval_shape(model_lib.Transformer(model_config).init, jax.random.PRNGKey(0),
                          tokens, tokens)['params']
    return sorted(tuple(leaf.shape) for leaf in jax.tree.leaves(tree))
  paper = config.model.copy_and_resolve_references()
  setattr(paper, key, configs_base.get_config().model[key])
  assert sorted(tuple(shape) for shape in saved.values()) == param_shapes(config.model)
  if value != 'predictive':  # Predictive positions are a fixed table: no weights of their own.
    assert param_shapes(config.model) != param_shapes(paper)


def test_speedrun_is_the_reference_model_with_rotary_positions_and_a_budgeted_schedule():
  tok, speedrun = multi30k.get_config('tok'), multi30k.get_config('speedrun')
  # The reference's architecture with rotary positions (the family comparison's best at this
  # rate); the dropout rate differs too (the run sees a third of the reference's tokens).
  assert speedrun.model.dropout == 0.2 and tok.model.dropout == 0.3
  assert (speedrun.model.positions, tok.model.positions) == ('rotary', 'sinusoidal')
  assert {**speedrun.model.to_dict(), 'dropout': 0.3,
          'positions': 'sinusoidal'} == tok.model.to_dict()
  assert speedrun.data.to_dict() == tok.data.to_dict()
  raw = multi30k.get_config('raw_speedrun')
  assert raw.data.train_src == 'train.en' and raw.eval.bleu_tokenize == '13a'
  assert raw.opt.to_dict() == speedrun.opt.to_dict() and raw.model.dropout == 0.2
  num_steps = speedrun.train.num_steps
  schedule = optim.learning_rate_schedule(speedrun.opt, speedrun.model.d_model, num_steps)
  uncooled = speedrun.opt.copy_and_resolve_references()
  uncooled.cooldown_steps = 0
  paper = optim.learning_rate_schedule(uncooled, tok.model.d_model)
  # The paper's schedule until the cooldown, then a ramp whose last update still moves the
  # weights.
  start = num_steps - speedrun.opt.cooldown_steps
  assert float(schedule(start - 1)) == pytest.approx(float(paper(start - 1)), rel=1e-6)
  assert 0 < float(schedule(num_steps - 1)) < 1e-3 * float(paper(num_steps - 1))
  assert speedrun.eval.bleu_sentences == -1  # Every evaluation scores all of valid.


@pytest.mark.slow
@pytest.mark.parametrize('while_training, expected', [(5, [5, 16]), (0, [16])])
def test_full_bleu_at_end_decodes_a_subset_while_training_and_every_sentence_at_the_end(
    tmp_path, monkeypatch, while_training, expected):
  data_dir = _fake_multi30k(tmp_path / 'multi30k')
  config = _shrunk('speedrun', data_dir)
  config.opt.cooldown_steps, config.eval.bleu_sentences = 3, while_training
  config.eval.full_bleu_at_end = True
  decoded = []
  translate = translator_lib.Translator.translate

  def counting(self, params, inputs, *args, **kwargs):
    decoded.append(len(inputs))
    return translate(self, params, inputs, *args, **kwargs)

  monkeypatch.setattr(translator_lib.Translator, 'translate', counting)
  results = train.train_and_evaluate(config, str(tmp_path / 'run'))
  assert results['step'] == 6
  assert decoded == expected  # Step 3: the first N valid sentences; the last step: all 16.


def test_a_run_without_bleu_draws_its_accuracies_in_bleus_place(tmp_path):
  series = plot.Series([100, 200], [0.5, 0.6], [10.0, 20.0])
  assert plot.middle_row({'bleu': series, 'eval/accuracy': series})[1] == 'BLEU'
  rows, label = plot.middle_row({'train/loss': series, 'eval/accuracy': series})
  assert label == 'accuracy' and ('eval/accuracy', 'validation accuracy') in rows
  plot.draw({'train/loss': series, 'eval/accuracy': series}, str(tmp_path / 'curves.png'), 'x')
  assert_drawn(tmp_path / 'curves.png')
