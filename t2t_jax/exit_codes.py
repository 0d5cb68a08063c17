"""Every exit status a t2t_jax command ends with, defined once: the commands use these, and so
do the launchers (launch/sweep.py; launch/slurm_step.sh holds PREEMPTED as a literal, which a
test compares with this one). docs/training.md tabulates them."""

import signal

OK = 0
ERROR = 1  # An error, said in one `error:` line: a config that cannot work, a failed save, ...
USAGE = 2  # A wrong command line (nothing was run), or processes that never joined each other.
HANG = 3  # The hang guard: a step or collective took longer than train.step_timeout_seconds.
PRUNED = 4  # A reporter (a search's pruner) stopped the run after saving (training/task.py).
INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C, as a shell reports it: 130.
PREEMPTED = 128 + signal.SIGTERM  # SIGTERM after saving: 143; schedulers requeue the job.
BY_SIGNAL = {signal.SIGTERM: PREEMPTED, signal.SIGINT: INTERRUPTED}
