#!/usr/bin/env bash
# What one GPU session runs end to end.
#
#   bench/gpu_session.sh all        # ONE device call (10 minutes at most): each part below
#                                   # in turn, the most wanted first, each cut to the time
#                                   # left before SESSION_SECONDS (default 540) runs out
#   bench/gpu_session.sh tests      # one device call (under 10 minutes): the suite's GPU part
#   bench/gpu_session.sh bench      # bench/accelerator.py, all parts: more than one call holds
#   bench/gpu_session.sh profile    # about 2 minutes: a profile of 3 speedrun steps
# on the GPU machine, from the repository root, $OUT set (the device tool's limit is 10
# minutes a call; a session lent 15 minutes of device time all told has room for one `all`).
#
# Prepare beside it, on a machine with PyPI (the image has jax, flax, optax, orbax and
# sentencepiece but not these; /work/.library/device/KINDS.md):
#   launch/wheelhouse.sh .whl --only 'ml_collections grain tensorboardX sacremoses \
#     array-record portpicker importlib_resources ctranslate2'
# and the versions the suite runs with, installed there only where the image's fall outside
# pyproject.toml's ranges (python3 -m pip download --no-deps --only-binary=:all:
#   --python-version 3.12 -d .carry/pins flax==V optax==V orbax-checkpoint==V),
# and, since ../shared does not travel to the GPU machine, copy the data and the reference in:
#   mkdir -p .carry && cp -r ../shared/data/multi30k ../shared/anchor/flax_wmt .carry/
# then run it with carry=['.whl', '.carry'] (both listed in .git/info/exclude).
# Writes under $OUT: the suite's GPU tests (pytest log), bench/accelerator.py's lines, the
# profile (its run's log and its trace folder as one .tgz), the environment and what was
# installed, and (all) each part's start, cap and exit; at most 8 files come back.
set -uo pipefail
: "${OUT:?set OUT to the folder whose files come back}"
part=${1:?say all, tests, bench or profile}
case $part in
  all|tests|bench|profile) ;;
  *) echo "error: bench/gpu_session.sh: unknown part '$part' (all, tests, bench or profile)" >&2
     exit 2 ;;
esac
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1

# The packages the image lacks, from the carried wheelhouse, without an index.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  --find-links .whl .whl/*.whl > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
# flax, optax and orbax from the image where they are inside pyproject.toml's ranges; else
# the carried pins (.carry/pins: the versions the suite runs with), named in the log.
for spec in flax:0.13 optax:0.3 orbax.checkpoint:0.13; do
  module=${spec%%:*} ceiling=${spec#*:}
  if ! python3 - "$module" "$ceiling" <<'PY' >> "$OUT/install.log" 2>&1; then
import importlib.metadata as m, sys
name = sys.argv[1].replace('.', '-')
have = m.version(name)
print(name, have, 'from the image')
ceiling = tuple(int(p) for p in sys.argv[2].split('.'))
sys.exit(tuple(int(p) for p in have.split('.')[:2]) >= ceiling)
PY
    wheel=$(ls .carry/pins/"${module//./_}"-*.whl 2>/dev/null | head -1)
    [[ -n $wheel ]] && python3 -m pip install -q --no-index --no-deps --no-compile \
      --target /tmp/site "$wheel" >> "$OUT/install.log" 2>&1 &&
      echo "  -> $wheel" >> "$OUT/install.log"
  fi
done
export PYTHONPATH=/tmp/site:$PWD
python3 -c 'import jax, flax, optax, grain, ml_collections; print(jax.__version__, flax.__version__,
optax.__version__, jax.devices())' >> "$OUT/gpu.txt" 2>&1

# What the parts run. The profile: configs/multi30k.py:speedrun through the training loop for
# 30 updates, steps 21 to 23 traced (accelerator.py's speedrun part times updates after 20
# warm-up ones), so the trace shows what those updates/s are made of (docs/performance.md, "A
# profile of chosen steps"); no BLEU, no cooldown (3,000 steps in the recipe, more than the
# run), one device as in the speedrun part. The GPU tests: the files that hold `gpu` tests (the
# image lacks optuna, which other test files import).
profile_run=(python3 -m t2t_jax.main --config=configs/multi30k.py:speedrun
  --workdir=/tmp/t2t_profile_run --config.data.data_dir=.carry/multi30k
  --config.mesh.shape='(1, 1, 1)' --config.train.num_steps=30 --config.train.eval_every=30
  --config.train.log_every=10 --config.opt.cooldown_steps=0 --config.eval.bleu_sentences=0
  --config.ckpt.every=0 --config.train.profile_steps='(21, 23)')
gpu_tests=(env T2T_TEST_GPU=1 python3 -m pytest -q -rs -m gpu tests/test_gpu.py
  tests/test_attention.py)
acc=(python3 bench/accelerator.py --out="$OUT/accelerator.jsonl" --data_dir=.carry/multi30k
  --anchor_dir=.carry/flax_wmt)
pack_profile() {
  [[ -d /tmp/t2t_profile_run/profile ]] &&
    tar -czf "$OUT/profile.tgz" -C /tmp/t2t_profile_run profile && ls -l "$OUT/profile.tgz"
}
rm -rf /tmp/t2t_profile_run

if [[ $part == all ]]; then
  # Each step gets at most its cap and never more than what is left; a step with under 20 s
  # left is skipped and says so. Every measurement is a line of accelerator.jsonl as it lands.
  deadline=$((SECONDS + ${SESSION_SECONDS:-540}))
  parts=" ${SESSION_PARTS:-train compare profile tests rest} "  # A rerun names fewer.
  step() {
    local name=$1 cap=$2 log=$3; shift 3
    [[ $parts == *" $name "* ]] || return 0
    local left=$((deadline - SECONDS))
    (( left < cap )) && cap=$left
    if (( cap < 20 )); then
      echo "skipped, ${left} s left: $*" | tee -a "$OUT/session.log"; return
    fi
    echo "[$SECONDS s] up to ${cap} s: $*" | tee -a "$OUT/session.log"
    timeout "$cap" "$@" >> "$log" 2>&1
    echo "[$SECONDS s] exit $?" | tee -a "$OUT/session.log"
  }
  # Issue 53's item 7 first: each measured train step beside its roofline prediction.
  step train 210 "$OUT/accelerator.log" "${acc[@]}" --parts=train_step --models=base,big \
    --token_slots=24576,49152
  step compare 150 "$OUT/accelerator.log" "${acc[@]}" --parts=compare,speedrun
  step profile 100 "$OUT/profile_run.log" "${profile_run[@]}" && pack_profile
  step tests 120 "$OUT/pytest_gpu.log" "${gpu_tests[@]}"
  step rest 400 "$OUT/accelerator.log" "${acc[@]}" --parts=attention,loss,decode,xla_ab
  echo "accelerator.jsonl: $(cat "$OUT/accelerator.jsonl" 2>/dev/null | wc -l) lines"
elif [[ $part == tests ]]; then
  # The GPU tests on the GPU, then the GPU-relevant files on the 8 simulated CPU devices.
  timeout 300 "${gpu_tests[@]}" 2>&1 | tee "$OUT/pytest_gpu.log"
  timeout 300 python3 -m pytest -q -rs tests/test_attention.py tests/test_runtime.py \
    tests/test_flops.py 2>&1 | tail -5 | tee "$OUT/pytest_cpu.log"
elif [[ $part == profile ]]; then
  timeout 300 "${profile_run[@]}" > "$OUT/profile_run.log" 2>&1
  echo "profile run exit $?" | tee -a "$OUT/profile_run.log"
  pack_profile
else  # bench: every part, at full shapes, as long as a call allows.
  timeout 570 "${acc[@]}" 2> "$OUT/accelerator.log"
  echo "accelerator.py exit $?; $(wc -l < "$OUT/accelerator.jsonl") lines"
fi
