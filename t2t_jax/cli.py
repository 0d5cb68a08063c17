"""What every command-line tool shares: one-line errors, a short usage line, strict JSON lines."""

import json
import logging as std_logging
import math
import re
import sys
import traceback
from typing import Any, Callable

from absl import app
from absl import flags
from absl import logging

USAGE_EXIT_CODE = 2  # Like argparse: a wrong command line, nothing was run.
ERROR_EXIT_CODE = 1



def json_line(record: dict[str, Any], reasons: dict[str, str] | None = None) -> str:
  """`record` as one line of strict JSON: NaN and infinities become null, the reason beside them.

  Reasons go under "null_reasons" ({key: why}); a non-finite value without one is explained
  by its value ("was nan"). Python's json would write NaN, which JSON parsers refuse.
  """
  reasons = dict(record.get('null_reasons') or {}, **(reasons or {}))

  def finite(value, key):
    if isinstance(value, float) and not math.isfinite(value):
      reasons.setdefault(key, f'was {value}')
      return None
    if isinstance(value, dict):
      return {k: finite(v, f'{key}.{k}' if key else k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [finite(v, f'{key}[{i}]') for i, v in enumerate(value)]
    return value

  cleaned = finite({k: v for k, v in record.items() if k != 'null_reasons'}, '')
  if reasons:
    cleaned['null_reasons'] = reasons
  return json.dumps(cleaned, allow_nan=False)


def run(main: Callable[[list[str]], Any]) -> None:
  """absl's app.run with errors a user can act on: one `error: ...` line, no traceback.

  The project's errors (config, data, checkpoint, a held workdir) and usage mistakes end the
  program with one line on stderr; usage mistakes add the command's usage line instead of the
  whole --help. Any other exception keeps its traceback. --verbose shows tracebacks always.
  """
  if 'verbose' not in flags.FLAGS:  # Defined here, so importing this module defines no flag.
    flags.DEFINE_bool('verbose', False, 'Show the traceback of an error, and the INFO logs of '
                      'the libraries (orbax, jax, ...).')
  app.run(_guarded(main), flags_parser=_parse_flags)


def _user_errors() -> tuple[type[Exception], ...]:
  """The error types whose message says what to do: no traceback needed."""
  from t2t_jax import ConfigError  # pylint: disable=g-import-not-at-top
  from t2t_jax import checkpoint, sources, workdir_lock  # pylint: disable=g-import-not-at-top
  return (ConfigError, sources.DataError, checkpoint.CheckpointError,
          workdir_lock.WorkdirLocked)


def _guarded(main):
  def guarded_main(argv):
    if not flags.FLAGS.verbose:
      quiet_libraries()
    try:
      return main(argv)
    except app.UsageError as e:
      _fail(str(e), usage=True)
    except Exception as e:  # pylint: disable=broad-except
      if not isinstance(e, _user_errors()):
        raise
      if flags.FLAGS.verbose:
        traceback.print_exc()
      _fail(str(e))
  return guarded_main


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    _fail(str(e), usage=True)
  except (AttributeError, KeyError) as e:  # ml_collections: --config.<key> names no key.
    _fail(_unknown_config_key(e, argv), usage=True)


def _unknown_config_key(error: Exception, argv: list[str]) -> str:
  """'--config.model.d_modle=3: no such config key 'd_modle'; did you mean "d_model"?'."""
  text = str(error)
  suggestion = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', text)
  key = suggestion.group(2) if suggestion else (re.findall(r"(\w+)", text) or ['?'])[0]
  flag = next((arg for arg in argv[1:] if arg.startswith('--config.') and
               key in arg.split('=')[0].split('.')), '--config')
  return (f'{flag}: no such config key {key!r}' +
          (f'; did you mean "{suggestion.group(1)}"?' if suggestion else
           '; configs/base.py lists every key'))


def _usage_line() -> str:
  """The first example command in the program's docstring."""
  doc = getattr(sys.modules.get('__main__'), '__doc__', None) or ''
  example = next((line.strip() for line in doc.splitlines()
                  if line.strip().startswith('python -m')), '')
  return f'usage: {example} (--helpshort lists the flags)' if example else (
      'usage: see --helpshort')


def _fail(message: str, usage: bool = False):
  logging.flush()
  message = ' '.join(message.split())  # One line, whatever the message held.
  print(f'error: {message}', file=sys.stderr)
  if usage:
    print(_usage_line(), file=sys.stderr)
  sys.stderr.flush()
  sys.exit(USAGE_EXIT_CODE if usage else ERROR_EXIT_CODE)


def quiet_libraries() -> None:
  """Hides the libraries' INFO chatter (orbax's per-save lines, ...); warnings still show."""
  logging.get_absl_handler().addFilter(
      lambda record: record.levelno >= std_logging.WARNING or '/t2t_jax/' in record.pathname)
