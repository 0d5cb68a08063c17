#!/usr/bin/env bash
# A t2t_jax run on a Cloud TPU VM pod slice: create, install, run on all workers, logs, delete.
#
#   launch/tpu_vm.sh create  NAME ZONE [ACCELERATOR_TYPE] [RUNTIME_VERSION]
#   launch/tpu_vm.sh install NAME ZONE          # copy this checkout, pip install it with jax[tpu]
#   launch/tpu_vm.sh run     NAME ZONE ARGS...  # python -m t2t_jax.main ARGS on every worker
#   launch/tpu_vm.sh logs    NAME ZONE [DIR]    # fetch each worker's log into DIR
#   launch/tpu_vm.sh delete  NAME ZONE
#
# Example: launch/tpu_vm.sh run t2t europe-west4-a --config=configs/wmt14_ende.py:big \
#            --workdir=gs://BUCKET/runs/big
# Every worker runs the same command; t2t_jax.main detects the TPU VM and calls
# jax.distributed.initialize, which finds the other workers itself. Use a gs:// workdir (or a
# shared filesystem) so that all workers write to the same checkpoints.
set -euo pipefail

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[[ $# -ge 3 ]] || usage
action=$1 name=$2 zone=$3
shift 3
tpu=(gcloud compute tpus tpu-vm)
remote_dir=t2t_jax
log=t2t_jax.log

case "${action}" in
  create)
    "${tpu[@]}" create "${name}" --zone="${zone}" \
      --accelerator-type="${1:-v4-32}" --version="${2:-tpu-ubuntu2204-base}"
    ;;
  install)
    repo=$(cd "$(dirname "$0")/.." && pwd)
    tar -C "${repo}" --exclude=.git -czf /tmp/t2t_jax_src.tgz .
    "${tpu[@]}" scp /tmp/t2t_jax_src.tgz "${name}:/tmp/" --zone="${zone}" --worker=all
    "${tpu[@]}" ssh "${name}" --zone="${zone}" --worker=all --command="
      mkdir -p ${remote_dir} && tar -C ${remote_dir} -xzf /tmp/t2t_jax_src.tgz &&
      pip install -U 'jax[tpu]' && pip install -e ${remote_dir}"
    ;;
  run)
    [[ $# -ge 1 ]] || usage
    args=$(printf '%q ' "$@")
    # nohup: the run survives a dropped ssh connection; each worker logs to ~/t2t_jax.log.
    "${tpu[@]}" ssh "${name}" --zone="${zone}" --worker=all --command="
      cd ${remote_dir} && nohup python -m t2t_jax.main ${args} > ~/${log} 2>&1 &"
    echo "started on all workers of ${name}; fetch logs with: $0 logs ${name} ${zone}"
    ;;
  logs)
    dir=${1:-logs_${name}}
    mkdir -p "${dir}"
    workers=$("${tpu[@]}" describe "${name}" --zone="${zone}" \
      --format='value(networkEndpoints.len())')
    for ((i = 0; i < workers; i++)); do
      "${tpu[@]}" scp "${name}:~/${log}" "${dir}/worker_${i}.log" --zone="${zone}" --worker="${i}"
    done
    echo "logs of ${workers} workers in ${dir}/"
    ;;
  delete)
    "${tpu[@]}" delete "${name}" --zone="${zone}" --quiet
    ;;
  *)
    usage
    ;;
esac
