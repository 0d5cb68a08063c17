"""Architecture checks: the repository's import graph and other whole-repository rules, read
from the source files (nothing here imports or runs the code it checks)."""

import ast
import os
import pathlib

from conftest import ROOT


# The package's import graph is a contract: pyproject.toml's [tool.importlinter] layers (the
# commands on top, the model and the data at the bottom), the model's and the data's
# independence, the training loop's forbidden imports and no circle among a package's modules,
# checked by import-linter on the package. The scripts (bench/, launch/, tests/) are not a
# package import-linter reads: the hand-written graph below finds circles through them too
# (docs/development.md, Style: "no import cycles, `bench/` included"): every import statement,
# at module level or inside a function, and every importlib.import_module('literal') call,
# between the repository's own modules.


def _contract_layers() -> list[list[str]]:
  import tomllib  # pylint: disable=g-import-not-at-top
  with open(os.path.join(ROOT, 'pyproject.toml'), 'rb') as f:
    contracts = tomllib.load(f)['tool']['importlinter']['contracts']
  layers = [c for c in contracts if c['type'] == 'layers']
  assert len(layers) == 1
  return [[name.strip() for name in layer.split('|')] for layer in layers[0]['layers']]


def test_the_import_contract_holds():
  # The use case, not importlinter.cli.lint_imports: that configures logging with
  # dictConfig, which disables every logger already made (absl's, t2t_jax's) for the tests
  # that run after it in the same worker.
  from importlinter.application import use_cases  # pylint: disable=g-import-not-at-top
  from importlinter import configuration  # pylint: disable=g-import-not-at-top
  configuration.configure()
  cwd = os.getcwd()
  os.chdir(ROOT)  # import-linter reads the package from here.
  try:
    kept = use_cases.lint_imports(config_filename=os.path.join(ROOT, 'pyproject.toml'),
                                  cache_dir=None, no_logo=True)
  finally:
    os.chdir(cwd)
  assert kept, 'lint-imports: a contract of pyproject.toml is broken (its report above)'


def test_every_module_of_the_package_is_in_a_layer():
  """A module added outside the layers would escape the contract."""
  layered = {name for layer in _contract_layers() for name in layer}
  package = pathlib.Path(ROOT) / 't2t_jax'
  top = {f't2t_jax.{path.stem}' for path in package.glob('*.py') if path.stem != '__init__'}
  top |= {f't2t_jax.{path.parent.name}' for path in package.glob('*/__init__.py')}
  assert top == layered, (f'not in a layer: {sorted(top - layered)}; '
                          f'in a layer but not a module: {sorted(layered - top)}')


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
  assert {'bench.compare', 'bench.decode_speed', 't2t_jax.training.train', 'configs.base'} <= set(graph)
  assert graph['bench.decode_speed'] >= {'bench.common', 'bench.flax_reference', 'bench.floor',
                                         't2t_jax.decoding.decode', 't2t_jax'}
  circle = find_circle(graph)
  assert not circle, 'import circle: ' + ' -> '.join(circle)


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


def test_every_command_and_benchmark_starts_through_cli_run():
  """absl's app.run would skip the huge pages, the flags and the cache the commands get."""
  root = pathlib.Path(ROOT)
  scripts = sorted((root / 'bench').glob('*.py')) + sorted((root / 't2t_jax').glob('*.py'))
  entries = [path for path in scripts if "__name__ == '__main__'" in path.read_text()]
  # The t2t_jax commands' run() calls cli.run (their modules are checked below).
  assert len(entries) >= 10
  for path in entries:
    text = path.read_text()
    assert 'app.run(' not in text, f'{path.name} starts with absl app.run, not cli.run'
    assert 'cli.run(' in text or 'runtime.start(' in text, path.name
