"""Documentation: every relative link in README.md and docs/ reaches a file and a heading, and
every repository path a page writes in code exists."""

import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = sorted([os.path.join(ROOT, 'README.md')]
               + glob.glob(os.path.join(ROOT, 'docs', '**', '*.md'), recursive=True))
_FENCE = re.compile(r'^```.*?^```', re.S | re.M)
_CODE_SPAN = re.compile(r'`[^`\n]*`')
_LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')
_HEADING = re.compile(r'^#{1,6}\s+(.*?)\s*#*\s*$', re.M)


def _prose(text: str) -> str:
  """The page without fenced code blocks and inline code, where brackets are not links."""
  return _CODE_SPAN.sub('', _FENCE.sub('', text))


def anchor(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r'\[([^\]]*)\]\([^)]*\)', r'\1', heading).replace('`', '').lower()
  return re.sub(r'[^\w\- ]', '', text).replace(' ', '-')


def anchors(path: str) -> set[str]:
  """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
  seen, result = {}, set()
  for heading in _HEADING.findall(_FENCE.sub('', open(path, encoding='utf-8').read())):
    slug = anchor(heading)
    count = seen.get(slug, 0)
    seen[slug] = count + 1
    result.add(slug if count == 0 else f'{slug}-{count}')
  return result


def relative_links(path: str) -> list[str]:
  """Link targets of a page that are neither URLs nor e-mail addresses."""
  links = _LINK.findall(_prose(open(path, encoding='utf-8').read()))
  return [link for link in links if not re.match(r'[a-z][a-z0-9+.-]*:', link)]


def test_anchor_follows_github():
  assert anchor('Reproducing a published result: Multi30k English→German') == (
      'reproducing-a-published-result-multi30k-englishgerman')
  assert anchor('The 60-minute recipe: `configs/multi30k.py:speedrun`') == (
      'the-60-minute-recipe-configsmulti30kpyspeedrun')
  assert anchor("The train step beside Flax's WMT example") == (
      'the-train-step-beside-flaxs-wmt-example')


@pytest.mark.parametrize('page', PAGES, ids=lambda page: os.path.relpath(page, ROOT))
def test_relative_links_reach_a_file_and_a_heading(page):
  broken = []
  for link in relative_links(page):
    target, _, fragment = link.partition('#')
    path = os.path.normpath(os.path.join(os.path.dirname(page), target)) if target else page
    name = os.path.relpath(path, ROOT)
    if not os.path.exists(path):
      broken.append(f'{link}: no file {name}')
      continue
    if fragment and fragment not in anchors(path):
      broken.append(f'{link}: no heading #{fragment} in {name}')
  assert not broken, f'{os.path.relpath(page, ROOT)}: ' + '; '.join(broken)


def test_pages_link_to_each_other():
  """Every docs page is reachable from the index."""
  index = os.path.join(ROOT, 'docs', 'README.md')
  linked = {os.path.normpath(os.path.join(ROOT, 'docs', link.partition('#')[0]))
            for link in relative_links(index)}
  orphans = [os.path.relpath(page, ROOT) for page in PAGES
             if os.path.dirname(page).endswith('docs') and page != index and page not in linked]
  assert not orphans, f'docs/README.md does not link {orphans}'


# The repository's top level: a path written from one of these in a page names a file of the
# repository (`configs/multi30k.py:speedrun`, `tests/test_cli.py::test_x`: the part before the
# variant or the test). Paths from elsewhere (`/tmp/run`, `../shared/...`) are the reader's.
REPOSITORY_TOP = ('.ci', 'bench', 'configs', 'docs', 'launch', 't2t_jax', 'tests',
                  'README.md', 'pyproject.toml')
_REPOSITORY_PATH = re.compile(r'(?<![\w./~-])((?:%s)(?:/[\w.*<>-]*)*)' % '|'.join(
    re.escape(top) for top in REPOSITORY_TOP))
# A module written dotted (`python -m t2t_jax.main`, `t2t_jax.training.train.train_and_evaluate`): its
# first name after the package must be a module or a subpackage of it.
_MODULE = re.compile(r'(?<![\w./~-])t2t_jax\.(\w+)')


def repository_paths(path: str) -> list[str]:
  """The repository paths a page writes in code (inline code spans and fenced blocks), a
  dotted module as the file or folder it names."""
  text = open(path, encoding='utf-8').read()
  code = _CODE_SPAN.findall(_FENCE.sub('', text)) + _FENCE.findall(text)
  paths = []
  for chunk in code:
    for match in _REPOSITORY_PATH.finditer(chunk):
      name = match.group(1).rstrip('.').split(':')[0]
      if name == 't2t_jax' and chunk[match.end():match.end() + 1] == '.':
        continue  # A dotted module: below.
      if not any(c in name for c in '*<>'):  # A pattern or a placeholder, not one path.
        paths.append(name)
    for match in _MODULE.finditer(chunk):
      module = match.group(1)
      folder = os.path.join('t2t_jax', module)
      paths.append(folder if os.path.isdir(os.path.join(ROOT, folder)) else f'{folder}.py')
  return paths


def test_repository_paths_are_found():
  """The regular expression finds paths in spans, commands and flags, and leaves others."""
  page = ('Run `python -m t2t_jax.main --config=configs/multi30k.py:speedrun` as '
          '`tests/test_cli.py::test_usage`; not `/tmp/t2t_jax/x.py`, `../shared/configs/y` or '
          '`bench/results/accelerator-<device>.jsonl`.\n```bash\npython launch/sweep.py '
          'configs/sweeps/tiny_grid.py\n```\n')
  import tempfile  # pylint: disable=g-import-not-at-top
  with tempfile.NamedTemporaryFile('w', suffix='.md') as f:
    f.write(page)
    f.flush()
    assert repository_paths(f.name) == ['configs/multi30k.py', 't2t_jax/main.py',
                                         'tests/test_cli.py', 'launch/sweep.py',
                                         'configs/sweeps/tiny_grid.py']


@pytest.mark.parametrize('page', PAGES, ids=lambda page: os.path.relpath(page, ROOT))
def test_every_repository_path_in_a_pages_code_exists(page):
  missing = sorted({name for name in repository_paths(page)
                    if not os.path.exists(os.path.join(ROOT, name))})
  assert not missing, f'{os.path.relpath(page, ROOT)} names paths that do not exist: {missing}'


def test_readme_layout_names_every_module_and_only_modules_that_exist():
  """The layout's t2t_jax/ tree, a package's modules indented under it, is the package's."""
  readme = open(os.path.join(ROOT, 'README.md')).read()
  layout = readme[readme.index('## Layout'):]
  block = layout[layout.index('```') + 3:]
  block = block[:block.index('```')]
  tree = block[block.index('t2t_jax/'):].split('\n')[1:]
  listed, package = set(), ''
  for line in tree:
    indent, name = len(line) - len(line.lstrip()), (line.split() or [''])[0]
    if indent == 0:
      break  # The next top-level folder.
    if indent == 2:
      package = name if name.endswith('/') else ''
    if name.endswith('.py') and indent == (4 if package else 2):
      listed.add(package + name)
  package_root = os.path.join(ROOT, 't2t_jax')
  modules = {os.path.relpath(os.path.join(directory, name), package_root)
             for directory, _, names in os.walk(package_root) for name in names
             if name.endswith('.py') and name != '__init__.py'}
  assert not modules - listed, f'missing from the README layout: {sorted(modules - listed)}'
  assert not listed - modules, f'in the README layout but not in t2t_jax/: {sorted(listed - modules)}'
