"""bench/: compare.py end to end on a tiny shape against the reference (if it is here), the
helpers it shares, its flags, and no import circle in the repository."""

import ast
import importlib.util
import json
import math
import os

from absl import flags
import jax
import jax.numpy as jnp
import pytest

from conftest import ROOT

REFERENCE_DIR = os.path.join(ROOT, '..', 'shared', 'anchor', 'flax_wmt')


def _load(name: str):
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, 'bench', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.mark.skipif(not os.path.isfile(os.path.join(REFERENCE_DIR, 'models.py')),
                    reason=f"Flax's WMT example (the reference) is not at {REFERENCE_DIR}")
def test_compare_runs_one_round_on_a_tiny_packed_shape(capsys):
  compare = _load('compare')
  [result] = compare.compare_shapes(compare.parse_flags([
      '--shapes=tiny_packed', '--rounds=1', '--steps=1', '--warmup=1',
      f'--reference_dir={REFERENCE_DIR}']))
  assert json.loads(capsys.readouterr().out.strip()) == result
  assert {'shape', 'vocab', 'd_model', 'rows', 'length', 'device_kind', 'device_count', 'dtype',
          'ratio_per_round', 'ratio_median', 'ratio_min', 'ratio_max',
          'matmul_flops_per_second', 't2t_jax', 'reference'} <= set(result)
  for ratio in result['ratio_per_round'] + [result['ratio_median']]:
    assert 0 < ratio < math.inf
  t2t, reference = result['t2t_jax'], result['reference']
  for side in (t2t, reference):
    assert {'step_seconds', 'tokens_per_second', 'xla_flops_per_step', 'model_flops_per_step',
            'share_of_matmul', 'mfu', 'compile_seconds'} <= set(side)
    assert 0 < side['share_of_matmul'] < math.inf and side['mfu'] is None  # No CPU peak.
    # XLA counts the matmuls and the elementwise rest: more than the model FLOPs, not double.
    assert 1 < side['xla_flops_per_step'] / side['model_flops_per_step'] < 2
  # Equal work: the same parameters and model FLOPs on both sides.
  assert t2t['params'] == reference['params']
  assert t2t['model_flops_per_step'] == reference['model_flops_per_step']


def test_packing_cuts_rows_into_segments_with_restarting_positions():
  batch = _load('compare').make_batch(_load('common').SHAPES['m30k_packed'], rows=5, length=64)
  segments, positions = batch['inputs_segments'], batch['inputs_positions']
  assert (segments[:, 0] == 1).all() and (segments[:, -1] == 4).all()
  assert (segments[:, 1:] - segments[:, :-1] >= 0).all()
  starts = segments[:, 1:] != segments[:, :-1]
  assert (positions[:, 1:][starts] == 0).all()
  assert (positions[:, 1:][~starts] == positions[:, :-1][~starts] + 1).all()


def test_t2t_config_takes_the_recipe_dropout_and_overrides():
  compare, common = _load('compare'), _load('common')
  args = compare.parse_flags(['--recipe=m30k', '--t2t_override', 'model.norm=post',
                              '--t2t_override', 'opt.warmup_steps=100'])
  config = compare.shape_config(common.SHAPES['m30k'], args)
  assert (config.model.dropout, config.model.attention_dropout,
          config.model.relu_dropout) == (0.3, 0.0, 0.0)
  assert config.model.norm == 'post' and config.opt.warmup_steps == 100
  assert (config.model.d_model, config.model.num_encoder_layers) == (128, 4)
  with pytest.raises(ValueError, match='model.no_such_key'):
    common.apply_override(config, 'model.no_such_key=1')


def test_compare_flags_keep_their_names_and_defaults():
  compare = _load('compare')
  args = compare.parse_flags([])
  assert {name: args[name].value for name in args} == {
      'shapes': ['small', 'm30k', 'm30k_packed', 'base'], 'rows': 0, 'length': 0,
      'dtype': 'float32', 'dropout': 0.1, 'attention_dropout': 0.1, 'relu_dropout': 0.1,
      'recipe': 'none', 'norm': 'pre', 't2t_override': [], 'rounds': 5, 'steps': 3,
      'warmup': 2, 'reference_dir': '../shared/anchor/flax_wmt'}
  args = compare.parse_flags(['--shapes=tiny,m30k', '--rounds', '7', '--steps=2'])
  assert (args.shapes, args.rounds, args.steps) == (['tiny', 'm30k'], 7, 2)
  with pytest.raises(flags.IllegalFlagValueError, match='no_such_shape'):
    compare.parse_flags(['--shapes=small,no_such_shape'])


@pytest.mark.parametrize('rows, source_length, steps', [(4, 5, 3), (12, 7, 6)])
def test_matmul_floor_does_the_matrix_products_it_claims(rows, source_length, steps):
  """XLA's count of the loop body's FLOPs is the formula's, plus a little elementwise work."""
  floor, shape = _load('floor'), _load('common').Shape(96, 32, 80, 2, 4, 0, 0)
  loop, x = floor.decoder_matmul_loop(shape, rows, source_length, steps)
  counted = _load('common').xla_flops(loop.lower(x).compile())
  e, f, layers = 32, 80, 2
  by_hand = layers * (
      6 * 2 * rows * e * e + 2 * 2 * rows * e * f  # Projections and the feed-forward pair.
      + 2 * 2 * rows * e * (steps + source_length)) + 2 * rows * e * 96  # Attention; output.
  assert 1 <= counted / by_hand < 1.1
  assert loop(x).shape == (rows, e)


def test_op_profile_splits_matrix_products_from_other_ops():
  common = _load('common')
  a = jnp.ones((256, 256))
  matmuls = jax.jit(lambda a: jax.lax.fori_loop(0, 20, lambda _, y: (y @ a) * 1e-3, a))
  elementwise = jax.jit(lambda a: jnp.tanh(jnp.exp(a * 0.5) + 1.0))
  for fn in (matmuls, elementwise):
    fn(a).block_until_ready()  # Compiled before the traced call.
  heavy = common.op_profile(lambda: matmuls(a).block_until_ready())
  light = common.op_profile(lambda: elementwise(a).block_until_ready())
  assert heavy['matmul_op_seconds'] > 0.5 * heavy['op_seconds'] > 0
  assert light['matmul_op_seconds'] == 0 < light['op_seconds']
  assert not any(kind.startswith(('dot', 'ynn_fusion')) for kind in light['top_op_kinds'])
  for profile in (heavy, light):
    assert profile['wall_seconds'] > 0 and len(profile['top_op_kinds']) <= 5


# No import circle in the repository (docs/DESIGN: "No import circles anywhere, bench/
# included"): every import statement, at module level or inside a function, and every
# importlib.import_module('literal') call, between the repository's own modules.


def _python_modules(root: str) -> dict[str, str]:
  """Every .py file under `root` by its dotted path (a package's __init__.py by the package)."""
  modules = {}
  for directory, subdirectories, files in os.walk(root):
    subdirectories[:] = sorted(d for d in subdirectories if not d.startswith(('.', '_')) and
                               d not in ('build', 'dist') and not d.endswith('.egg-info') and
                               not os.path.exists(os.path.join(directory, d, 'pyvenv.cfg')))
    for name in files:
      if name.endswith('.py'):
        parts = os.path.relpath(os.path.join(directory, name[:-3]), root).split(os.sep)
        modules['.'.join(parts[:-1] if parts[-1] == '__init__' else parts)] = os.path.join(
            directory, name)
  return modules


def _imported_names(tree: ast.AST, module: str, is_package: bool):
  """(absolute dotted name, names taken from it) of every import in `tree`, anywhere."""
  package = module if is_package else module.rpartition('.')[0]
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield alias.name, ()
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:  # Relative: from the package, up level - 1.
        anchor = package.split('.')[:len(package.split('.')) - node.level + 1]
        base = '.'.join(anchor + ([node.module] if node.module else []))
      yield base, tuple(alias.name for alias in node.names)
    elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and
          node.func.attr == 'import_module' and node.args and
          isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
      yield node.args[0].value, ()


def import_graph(root: str) -> dict[str, set[str]]:
  """Module -> the repository's modules it imports.

  A script folder (one without __init__.py, such as bench/ or tests/) is on sys.path when its
  scripts run, so a bare name there means the folder's own module first. `from package import
  name` reaches package.name where that is a module, else the package's __init__. A package's
  __init__ runs before its submodules, but counts only where a name is taken from it.
  """
  modules = _python_modules(root)
  graph = {}
  for module, path in modules.items():
    is_package = path.endswith('__init__.py')
    folder = os.path.dirname(path)
    script_prefix = ('' if os.path.exists(os.path.join(folder, '__init__.py')) or
                     folder == root else module.rpartition('.')[0] + '.')

    def resolve(name: str) -> str | None:
      for candidate in ([script_prefix + name] if script_prefix else []) + [name]:
        if candidate in modules:
          return candidate
      return None

    with open(path, encoding='utf-8') as f:
      tree = ast.parse(f.read(), path)
    targets = set()
    for base, names in _imported_names(tree, module, is_package):
      submodules = [resolve(f'{base}.{name}') for name in names]
      targets.update(target for target in submodules if target)
      if not names or not all(submodules):  # The module itself, or names from its body.
        target = resolve(base)
        if target:
          targets.add(target)
    graph[module] = targets - {module}
  return graph


def find_circle(graph: dict[str, set[str]]) -> list[str]:
  """One import circle as [a, b, ..., a], or [] if there is none."""
  state, path = {}, []

  def visit(module):
    state[module] = 'open'
    path.append(module)
    for target in sorted(graph.get(module, ())):
      if state.get(target) == 'open':
        return path[path.index(target):] + [target]
      if target not in state:
        circle = visit(target)
        if circle:
          return circle
    state[module] = 'done'
    path.pop()
    return []

  for module in sorted(graph):
    if module not in state:
      circle = visit(module)
      if circle:
        return circle
  return []


def test_no_import_circle_in_the_repository():
  graph = import_graph(ROOT)
  assert {'bench.compare', 'bench.decode_speed', 't2t_jax.train', 'configs.base'} <= set(graph)
  assert graph['bench.decode_speed'] >= {'bench.common', 'bench.flax_reference', 'bench.floor',
                                         't2t_jax.decode', 't2t_jax'}
  circle = find_circle(graph)
  assert not circle, 'import circle: ' + ' -> '.join(circle)


def test_no_bench_module_shadows_the_references_modules():
  """flax_reference imports the reference's modules by bare name, with bench/ on sys.path."""
  bench = {name[:-3] for name in os.listdir(os.path.join(ROOT, 'bench')) if name.endswith('.py')}
  assert not bench & set(_load('flax_reference').REFERENCE_MODULES)


def test_the_import_graph_sees_every_form_of_import(tmp_path):
  files = {
      'pkg/__init__.py': 'CONSTANT = 1\n',
      'pkg/a.py': 'from pkg import b\nfrom pkg import CONSTANT\n',
      'pkg/b.py': 'def f():\n  from pkg.c import g\n  return g\n',  # Function-level.
      'pkg/c.py': 'import os\nfrom . import d\nfrom .d import h\n\ndef g():\n  pass\n',
      'pkg/d.py': 'import pkg.a\n\ndef h():\n  pass\n',
      'scripts/run.py': 'import helper\nimport pkg.c\n',
      'scripts/helper.py': 'import importlib\nimportlib.import_module("run")\n',
  }
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text(text)
  graph = import_graph(str(tmp_path))
  assert graph == {'pkg': set(), 'pkg.a': {'pkg.b', 'pkg'}, 'pkg.b': {'pkg.c'},
                   'pkg.c': {'pkg.d'}, 'pkg.d': {'pkg.a'},
                   'scripts.run': {'scripts.helper', 'pkg.c'},
                   'scripts.helper': {'scripts.run'}}
  assert find_circle(graph) == ['pkg.a', 'pkg.b', 'pkg.c', 'pkg.d', 'pkg.a']
  del graph['pkg.d']
  assert find_circle(graph) == ['scripts.helper', 'scripts.run', 'scripts.helper']
