"""Flax's WMT example (the reference) imported for the side-by-side benchmarks, never copied."""

import importlib
import importlib.util
import os
import sys
import types

# The reference's modules, imported by these bare names: no bench module may take one of them.
REFERENCE_MODULES = ('models', 'train', 'decode', 'bleu', 'input_pipeline', 'tokenizer')

# Imported by the reference's train.py for its own loop and input pipeline, never run here.
_STUBBED = ('clu', 'tensorflow', 'tensorflow_datasets', 'tensorflow_text', 'sentencepiece')


class _Stub(types.ModuleType):
  """Stands in for a missing package: any attribute, item or call gives the stub again."""

  def __getattr__(self, name):
    if name.startswith('__'):  # Keeps the import machinery's probes honest.
      raise AttributeError(name)
    return self

  def __getitem__(self, key):
    return self

  def __call__(self, *args, **kwargs):
    return self


def import_reference(reference_dir: str) -> types.SimpleNamespace:
  """The reference's `models`, `train` and `decode`; packages only its loop uses may be absent."""
  directory = os.path.abspath(reference_dir)
  if not os.path.isfile(os.path.join(directory, 'models.py')):
    raise FileNotFoundError(f'--reference_dir={reference_dir} ({directory}) holds no models.py: '
                            "point it at a copy of Flax's examples/wmt")
  for name in REFERENCE_MODULES:
    module = sys.modules.get(name)
    if module is not None and os.path.dirname(getattr(module, '__file__', '') or '') != directory:
      raise ImportError(f'a module {name!r} from {module.__file__} is already imported, so the '
                        f"reference's {name}.py in {directory} would not be: run the benchmark in "
                        'a process of its own')
  # Flax's checkpoint module asks whether TensorFlow exists when first imported: let it see
  # the truth before any stub stands in.
  importlib.import_module('flax.training.checkpoints')
  for package in _STUBBED:
    if package not in sys.modules and importlib.util.find_spec(package) is None:
      sys.modules[package] = _Stub(package)
  sys.path.insert(0, directory)
  return types.SimpleNamespace(models=importlib.import_module('models'),
                               train=importlib.import_module('train'),
                               decode=importlib.import_module('decode'))
