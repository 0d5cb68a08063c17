"""launch/wheelhouse.sh for real, on a small scope: the wheels the GPU image lacks, for its
Python 3.12, and the project's own wheel; then installed from the wheelhouse alone."""

import os
import shlex
import subprocess
import urllib.request

import pytest

from conftest import ROOT

# What the lent GPU machines' image lacks of t2t_jax's needs (/work/.library/device/KINDS.md),
# with their own needs the image lacks too.
IMAGE_LACKS = 'ml_collections grain tensorboardX sacremoses array-record portpicker importlib_resources'


def _pypi_reachable() -> bool:
  try:
    with urllib.request.urlopen('https://pypi.org/simple/sacremoses/', timeout=10):
      return True
  except OSError:
    return False


@pytest.mark.slow
@pytest.mark.skipif(not _pypi_reachable(), reason='PyPI is unreachable from here')
def test_wheelhouse_installs_the_gpu_images_missing_packages_without_an_index(tmp_path):
  wheelhouse = tmp_path / 'wheels'
  built = subprocess.run([os.path.join(ROOT, 'launch', 'wheelhouse.sh'), str(wheelhouse),
                          '--only', IMAGE_LACKS], capture_output=True, text=True, timeout=600,
                         check=False)
  assert built.returncode == 0, built.stderr[-3000:]
  command = shlex.split(built.stdout.strip().splitlines()[-1])
  assert command[:6] == ['python3', '-m', 'pip', 'install', '--no-index', '--no-deps']
  wheels = sorted(os.listdir(wheelhouse))
  assert any(name.startswith('t2t_jax-') for name in wheels)
  assert any(name.startswith('grain-') and 'cp312' in name for name in wheels)
  # The printed command, as the target machine (Python 3.12, x86-64 Linux) runs it, into a
  # folder: --target lets pip install for another Python than this one; pip matches each
  # manylinux tag exactly, so every tag the target's glibc (2.28 or newer) accepts is named.
  target = tmp_path / 'site'
  installed = subprocess.run(
      command + ['--target', str(target), '--python-version', '3.12', '--implementation', 'cp',
                 '--only-binary=:all:']
      + [f'--platform=manylinux_2_{n}_x86_64' for n in (17, 24, 27, 28)],
      capture_output=True, text=True, timeout=300, check=False)
  assert installed.returncode == 0, installed.stderr[-3000:]
  for module in ('t2t_jax/runtime.py', 'configs/multi30k.py', 'grain', 'ml_collections',
                 'tensorboardX', 'sacremoses', 'array_record', 'portpicker.py'):
    assert (target / module).exists(), module
