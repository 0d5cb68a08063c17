"""CTranslate2 is an optional dependency (the `ctranslate2` extra): the modules that need it are
imported on demand, and without it the flag that asked for it says how to install it."""

import importlib

from t2t_jax import ConfigError


def export_ctranslate2(workdir: str, checkpoint_name: str | None = None, output: str = '',
                       quantization: str | None = None, weights: str = 'params') -> str:
  """Writes the CTranslate2 model of one checkpoint; returns the directory written."""
  ctranslate2_export = import_needing_ctranslate2('t2t_jax.deploy.export_ctranslate2',
                                                  '--format=ctranslate2')
  return ctranslate2_export.export(workdir, checkpoint_name, output, quantization, weights)


def import_needing_ctranslate2(module: str, flag: str):
  """Imports `module` (ctranslate2, or a module that imports it); without the ctranslate2
  package, a ConfigError saying which `flag` needs it and how to install it."""
  try:
    return importlib.import_module(module)
  except ModuleNotFoundError as e:
    if e.name != 'ctranslate2':
      raise
    raise ConfigError(f"{flag} needs the ctranslate2 package: pip install "
                      "'t2t_jax[ctranslate2]'") from None
