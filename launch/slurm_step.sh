#!/bin/bash
# Runs a command as one SLURM job step (srun: one copy per task) and requeues the job when the
# step ends preempted: t2t_jax exits with 143 after saving a checkpoint on SIGTERM, whether the
# signal came from `#SBATCH --signal` before the time limit or from `scancel --signal=TERM`.
# The requeued job runs the same command, which resumes from that checkpoint. Used by
# launch/slurm.sbatch and by the array jobs of launch/sweep.py --mode=slurm.
#
#   launch/slurm_step.sh python -m t2t_jax.main --config=... --workdir=...
set -uo pipefail
readonly PREEMPTED=143  # t2t_jax.exit_codes.PREEMPTED (a test compares them)
# A job requeued onto fewer tasks (scontrol update JobId=... NumTasks=N TasksPerNode=M while it
# waits) keeps sbatch's SLURM_NTASKS of the submission, and srun would start that many again
# (or fail where the allocation has fewer CPUs now): count this allocation's tasks instead
# ("2(x3),1": 2 on each of 3 nodes, then 1).
if [[ -n "${SLURM_NTASKS:-}" && -n "${SLURM_TASKS_PER_NODE:-}" ]]; then
  tasks=0
  IFS=, read -ra counts <<< "${SLURM_TASKS_PER_NODE}"
  for count in "${counts[@]}"; do
    if [[ ${count} =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
      tasks=$(( tasks + BASH_REMATCH[1] * BASH_REMATCH[2] ))
    else
      tasks=$(( tasks + count ))
    fi
  done
  export SLURM_NTASKS=${tasks} SLURM_NPROCS=${tasks}
fi
echo "slurm_step.sh: job ${SLURM_JOB_ID}, restart ${SLURM_RESTART_COUNT:-0}," \
     "${SLURM_NTASKS:-1} task(s) on ${SLURM_JOB_NODELIST:-?}"
# Kill the whole step when one process fails, rather than leaving the others waiting on it.
srun --kill-on-bad-exit=1 "$@"
status=$?
if (( status == PREEMPTED )); then
  echo "slurm_step.sh: preempted (exit status ${status}): requeueing job ${SLURM_JOB_ID}"
  scontrol requeue "${SLURM_JOB_ID}"
fi
exit "${status}"
