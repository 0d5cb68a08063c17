"""The errors whose message says what was wrong and what to do: a command prints one line for
them (cli.py), with no traceback. Each is raised where the fault is found and defined here, so
that the commands know them without importing the layers below."""


class ConfigError(ValueError):
  """A config value (or a flag standing for one) that cannot work, named with what to do."""


class NonFiniteLoss(FloatingPointError):
  """Training stopped at a NaN or infinite loss; the message names the step and what to do."""


class CheckpointError(RuntimeError):
  """A checkpoint that cannot be used, naming it and saying what to do."""


class DataError(ValueError):
  """Bad input data, with the file and line at fault."""


class DiskFull(RuntimeError):
  """A write other than a checkpoint's failed for want of space (checkpoints say so in their
  own CheckpointError)."""


class WorkdirLocked(RuntimeError):
  """Another live run holds the workdir."""


class WorkdirUnusable(RuntimeError):
  """The workdir path names a file, or a directory that cannot be created."""


# What a command reports in one line (cli.py).
USER_ERRORS = (ConfigError, NonFiniteLoss, DataError, CheckpointError, DiskFull, WorkdirLocked,
               WorkdirUnusable)
