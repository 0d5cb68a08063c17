#!/usr/bin/env bash
# A wheelhouse for a cluster without internet: every wheel t2t_jax needs for one Python version
# and platform, built on a machine with PyPI, then copied over (docs/accelerators.md).
#
#   launch/wheelhouse.sh DIR                          # t2t_jax[cuda13] and all it needs, Python 3.12
#   launch/wheelhouse.sh DIR --extras=cuda12 --python-version=3.11
#   launch/wheelhouse.sh DIR --only 'grain ml_collections'  # t2t_jax and these alone, no
#                                                     # dependencies: tops up an image that has the rest
#
# Options: --python-version (3.12), --extras (cuda13; '' for none), --platform (repeatable;
# default the manylinux x86-64 tags pip matches exactly, 2_17 to 2_28), --only 'NAMES'.
# Prints the install command for the target machine last.
set -euo pipefail

usage() { sed -n '2,13p' "$0" >&2; exit 2; }
[[ $# -ge 1 && $1 != -* ]] || usage
dir=$1; shift
python_version=3.12 extras=cuda13 only='' platforms=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --python-version=*) python_version=${1#*=} ;;
    --extras=*) extras=${1#*=} ;;
    --platform=*) platforms+=("${1#*=}") ;;
    --only) only=$2; shift ;;
    --only=*) only=${1#*=} ;;
    *) echo "wheelhouse.sh: unknown option $1" >&2; usage ;;
  esac
  shift
done
if [[ ${#platforms[@]} -eq 0 ]]; then
  platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
             manylinux_2_17_x86_64 manylinux2014_x86_64)
fi
root=$(cd "$(dirname "$0")/.." && pwd)
pip=(${PIP:-python3 -m pip})
mkdir -p "$dir"

# The project itself: pure Python, so one wheel fits every platform.
"${pip[@]}" wheel --quiet --no-deps --wheel-dir "$dir" "$root"
project=$(ls -t "$dir"/t2t_jax-*.whl | head -1)

target=(--only-binary=:all: --python-version "$python_version" --implementation cp)
for platform in "${platforms[@]}"; do target+=(--platform "$platform"); done
spec=t2t_jax${extras:+[$extras]}
if [[ -n $only ]]; then
  # shellcheck disable=SC2086  # NAMES is a list.
  "${pip[@]}" download --quiet --no-deps "${target[@]}" --dest "$dir" $only
  flags='--no-deps '
  names="t2t_jax $only"
else
  "${pip[@]}" download --quiet "${target[@]}" --dest "$dir" "$project${extras:+[$extras]}"
  flags=''
  names="'$spec'"
fi
echo "wheelhouse: $(ls "$dir" | wc -l) wheels in $dir for Python $python_version" >&2
echo "python3 -m pip install --no-index ${flags}--find-links $dir $names"
