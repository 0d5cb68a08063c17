"""What every command-line tool shares: one-line errors, a short usage line, strict JSON lines."""

import json
import logging as std_logging
import math
import os
import re
import sys
import threading
import traceback
from typing import Any, Callable

from absl import app
from absl import flags
from absl import logging

from t2t_jax import RENAMED_KEYS
from t2t_jax import errors
from t2t_jax import exit_codes
from t2t_jax import runtime


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


def run(main: Callable[[list[str]], Any],
        compilation_cache: str | None = runtime.DEFAULT_COMPILATION_CACHE) -> None:
  """absl's app.run with errors a user can act on: one `error: ...` line, no traceback.

  The project's errors (config, data, checkpoint, a held or unusable workdir, a non-finite
  loss) and usage mistakes end the program with one line on stderr; usage mistakes add the
  command's usage line instead of the whole --help. Ctrl-C outside training's own handling
  ends with one line and status 130. Any other exception keeps its traceback. --verbose shows
  tracebacks always. The process is set up by `runtime` (huge pages on CPU before the flags
  are parsed; XLA flags and the compilation cache, `--compilation_cache`, after).
  """
  runtime.reexec_with_huge_pages(sys.argv)  # Before anything allocates much.
  if 'verbose' not in flags.FLAGS:  # Defined here, so importing this module defines no flag.
    flags.DEFINE_bool('verbose', False, 'Show the traceback of an error, and the INFO logs of '
                      'the libraries (orbax, jax, ...).')
    flags.DEFINE_string('compilation_cache', compilation_cache, 'Persistent XLA compilation '
                        'cache directory; empty disables it'
                        + ('' if compilation_cache else "; unset leaves JAX's setting") + '.')
  app.run(_guarded(main), flags_parser=_parse_flags)


def _user_errors() -> tuple[type[Exception], ...]:
  """The error types whose message says what to do: no traceback needed."""
  return errors.USER_ERRORS


def _guarded(main):
  def guarded_main(argv):
    if not flags.FLAGS.verbose:
      quiet_libraries()
    runtime.start(flags.FLAGS.compilation_cache)
    try:
      return main(argv)
    except app.UsageError as e:
      _fail(str(e), usage=True)
    except KeyboardInterrupt:
      if flags.FLAGS.verbose:
        traceback.print_exc()
      _fail('interrupted (Ctrl-C); checkpoints already written are intact', exit_code=
            exit_codes.INTERRUPTED)
    except Exception as e:  # pylint: disable=broad-except
      if not isinstance(e, _user_errors()):
        raise
      if flags.FLAGS.verbose:
        traceback.print_exc()
      _fail(str(e))
  return guarded_main


def _parse_flags(argv: list[str]) -> list[str]:
  try:
    remaining = flags.FLAGS(argv)
  except flags.Error as e:
    _fail(_without_traceback(str(e)), usage=True)
  except (AttributeError, KeyError) as e:  # ml_collections: --config.<key> names no key.
    _fail(_unknown_config_key(e, argv), usage=True)
  except Exception as e:  # pylint: disable=broad-except
    failed = _config_file_error(e, argv)  # A config file's own error, met while parsing it.
    if failed is None:
      raise
    _fail(failed, usage=True)
  _check_config_files()
  return remaining


def _without_traceback(text: str) -> str:
  """A flag error as its own message: ml_collections puts a config's whole traceback in it."""
  head, marker, trace = text.partition('Traceback (most recent call last):')
  if not marker:
    return text
  # The raised error is the last unindented line of the traceback ('ValueError: ...').
  raised = [line for line in trace.splitlines() if line and not line[0].isspace()]
  message = raised[-1] if raised else trace
  message = re.sub(r'^\w+(Error|Exception): ', '', message)
  head = head.replace('Error whilst parsing config file:', '').strip()
  flag = re.match(r'flag (--\w+)=(\S+):$', head)
  if flag and message.startswith(f'{flag.group(2)}: '):  # The config names itself: say it once.
    return f'{flag.group(1)}={flag.group(2)}: {message[len(flag.group(2)) + 2:]}'
  return f'{head} {message}'


def _check_config_files() -> None:
  """A config file that cannot be loaded, named now: ml_collections defers the error until
  the config is first read, deep inside the program."""
  from ml_collections import config_flags  # pylint: disable=g-import-not-at-top
  for name in list(flags.FLAGS):
    flag = flags.FLAGS[name]
    try:
      path = config_flags.get_config_filename(flag).split(':', 1)[0]
    except (TypeError, AttributeError):
      continue  # Not a config file flag, or one not given.
    try:
      getattr(flag.value, 'lock')
    except OSError as e:
      if not os.path.isfile(path):
        _fail(f'--{name}={path}: no such config file (relative paths start at '
              f'{os.getcwd()}); configs/ holds the configs, e.g. configs/default.py',
              usage=True)
      cause = e.__cause__ or e
      _fail(f'--{name}={path}: the config cannot be loaded: {" ".join(str(cause).split())}',
            usage=True)
    except Exception as e:  # pylint: disable=broad-except
      # The file's own error (a syntax error, a misspelt name in get_config): where it is.
      _fail(f'--{name}={load_error(e, path)}', usage=True)


def load_error(error: BaseException, path: str) -> str:
  """Why a Python file (a config, a sweep) could not be loaded, as 'PATH:LINE: Type: message':
  the line is the file's own (a syntax error's, or the innermost frame of the file in the
  traceback), not that of the code that imported it."""
  line, message = None, str(error)
  if isinstance(error, SyntaxError) and error.filename and _same_file(error.filename, path):
    line, message = error.lineno, error.msg
  else:
    for frame in traceback.extract_tb(error.__traceback__):
      if _same_file(frame.filename, path):
        line = frame.lineno
  where = f'{path}:{line}' if line else path
  return f'{where}: {type(error).__name__}: {" ".join(message.split())}'


def _config_file_error(error: Exception, argv: list[str]) -> str | None:
  """'--config=FILE:LINE: Type: message' where `error` was raised by the Python file a flag
  names; None where it was not."""
  files = [frame.filename for frame in traceback.extract_tb(error.__traceback__)]
  if isinstance(error, SyntaxError) and error.filename:
    files.append(error.filename)
  for arg in argv[1:]:
    name, _, value = arg.partition('=')
    path = value.split(':', 1)[0]
    if name.startswith('--') and path.endswith('.py') and any(_same_file(f, path)
                                                               for f in files):
      return f'{name}={load_error(error, path)}'
  return None


def _same_file(a: str, b: str) -> bool:
  return os.path.abspath(a) == os.path.abspath(b)


def _unknown_config_key(error: Exception, argv: list[str]) -> str:
  """'--config.model.d_modle=3: no such config key 'd_modle'; did you mean "d_model"?'."""
  text = str(error)
  suggestion = re.search(r'Did you mean "([^"]+)" instead of "([^"]+)"', text)
  key = suggestion.group(2) if suggestion else (re.findall(r"(\w+)", text) or ['?'])[0]
  flag = next((arg for arg in argv[1:] if arg.startswith('--config.') and
               key in arg.split('=')[0].split('.')), '--config')
  renamed = RENAMED_KEYS.get(flag.split('=')[0].removeprefix('--config.'))
  if renamed:
    return f'{flag}: config key {key!r} was renamed: use --config.{renamed}'
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


def _fail(message: str, usage: bool = False, exit_code: int | None = None):
  logging.flush()
  message = ' '.join(message.split())  # One line, whatever the message held.
  print(f'error: {message}', file=sys.stderr)
  if usage:
    print(_usage_line(), file=sys.stderr)
  sys.stderr.flush()
  sys.exit(exit_code or (exit_codes.USAGE if usage else exit_codes.ERROR))


def read_input_lines(path: str, flag: str = '--input') -> list[str]:
  """The lines of `path` (stdin when empty), or a UsageError naming the flag and the fault."""
  if not path:
    return sys.stdin.read().splitlines()
  try:
    with open(path, encoding='utf-8') as f:
      return f.read().splitlines()
  except OSError as e:
    raise app.UsageError(f'cannot read {flag}={path}: {e.strerror}')
  except UnicodeDecodeError as e:
    raise app.UsageError(f'{flag}={path} is not UTF-8 text (byte {e.start})')


def check_output_path(path: str, flag: str) -> None:
  """Refuses (as a usage mistake) an output file that cannot be created, before any work."""
  directory = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    raise app.UsageError(f'{flag}={path} is a directory: name a file in it')
  if not os.path.isdir(directory):
    raise app.UsageError(f'{flag}={path}: the directory {directory} does not exist: create it '
                         'or choose another path')
  if not os.access(directory, os.W_OK):
    raise app.UsageError(f'{flag}={path}: the directory {directory} is not writable: choose '
                         'another path')


def quiet_libraries() -> None:
  """Hides the libraries' INFO chatter (orbax's per-save lines, ...); their warnings and errors
  still show, each as its message without the traceback (the Checkpointer stops a run after a
  failed save with one line naming the checkpoint and the cause). A background thread that dies
  is one warning line. --verbose shows everything, tracebacks included."""
  handler = logging.get_absl_handler()
  if not any(isinstance(f, _LibraryRecords) for f in handler.filters):
    handler.addFilter(_LibraryRecords())
  previous = threading.excepthook
  if getattr(previous, 'one_line', False):
    return

  def thread_failed(hook_args) -> None:
    if hook_args.exc_type is not SystemExit:
      logging.warning('Background thread %s ended with %s: %s (--verbose shows the traceback)',
                      getattr(hook_args.thread, 'name', '?'), hook_args.exc_type.__name__,
                      ' '.join(str(hook_args.exc_value).split())[:300])
    if previous is not threading.__excepthook__:  # A hook someone else installed still runs.
      previous(hook_args)
  thread_failed.one_line = True
  threading.excepthook = thread_failed


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


class _LibraryRecords(std_logging.Filter):
  """t2t_jax's own records as they are; other libraries' from WARNING up, as their message and
  the exception's one line, without the traceback."""

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.pathname.startswith(_PACKAGE):
      return True
    if record.levelno < std_logging.WARNING:
      return False
    message = record.getMessage()
    head, marker, trace = message.partition('Traceback (most recent call last):')
    if marker:  # A traceback printed into the message: its last line is the error.
      raised = [line for line in trace.splitlines() if line and not line[0].isspace()]
      message = ' '.join(f'{head.strip()} {raised[-1] if raised else ""}'.split())
    if record.exc_info and record.exc_info[1] is not None:
      error = record.exc_info[1]
      message += f' ({type(error).__name__}: {" ".join(str(error).split())[:300]})'
    if marker or record.exc_info or record.exc_text:
      record.msg, record.args = f'{message} (--verbose shows the traceback)', ()
      record.exc_info = record.exc_text = None
    return True


def call_file_function(path: str, function: str, error: type[Exception], what: str):
  """Runs `function`() of the Python file at `path` (a sweep or search file) and returns its
  value; a file that is missing, lacks the function or fails to run raises `error` of one
  line naming where (load_error)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  spec = importlib.util.spec_from_file_location(f'{what}_file', path)
  if spec is None or not os.path.isfile(path):
    raise error(f'{path}: no such {what} file')
  module = importlib.util.module_from_spec(spec)
  try:
    spec.loader.exec_module(module)
    if not callable(getattr(module, function, None)):
      raise error(f'{path}: a {what} file must define {function}()')
    return getattr(module, function)()
  except error:
    raise
  except Exception as e:  # pylint: disable=broad-except
    # The file's own error (a syntax error, a misspelt name): where it is, in one line.
    raise error(load_error(e, path)) from e


def format_cell(value) -> str:
  """A table cell: '-' for None, 4 significant digits for floats."""
  if value is None:
    return '-'
  if isinstance(value, float):
    return f'{value:.4g}'
  return str(value)


def text_table(head: list[str], rows: list[list[str]], markdown: bool = False) -> str:
  """Columns padded to their widest cell, or a GitHub markdown table."""
  if markdown:
    return '\n'.join('| ' + ' | '.join(cell.replace('|', '\\|') for cell in row) + ' |'
                     for row in [head, ['---'] * len(head)] + rows)
  widths = [max(len(row[i]) for row in rows + [head]) for i in range(len(head))]
  return '\n'.join('  '.join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                   for row in [head] + rows)
