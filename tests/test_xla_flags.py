"""t2t_jax/xla_flags.py: the GPU XLA flags are added only where a CUDA backend may start, never
over the user's own, and every flag the A/B measures is one this XLA knows."""

import os
import subprocess
import sys

from t2t_jax import xla_flags


def test_merge_keeps_what_the_user_set_and_adds_the_rest():
  merged = xla_flags.merge('--xla_gpu_enable_latency_hiding_scheduler=false --foo=1',
                           ('--xla_gpu_enable_latency_hiding_scheduler=true',
                            '--xla_gpu_enable_triton_gemm=false'))
  assert merged.split() == ['--xla_gpu_enable_latency_hiding_scheduler=false', '--foo=1',
                            '--xla_gpu_enable_triton_gemm=false']
  assert xla_flags.merge('', ()) == ''


def test_apply_sets_the_defaults_only_where_cuda_may_start(monkeypatch):
  monkeypatch.setattr(xla_flags, 'cuda_plugin_installed', lambda: True)
  environ = {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  assert xla_flags.apply(environ) == xla_flags.GPU_DEFAULTS
  assert environ['XLA_FLAGS'].split() == ['--xla_force_host_platform_device_count=8',
                                          *xla_flags.GPU_DEFAULTS]
  assert xla_flags.apply(environ) == ()  # A second call adds nothing.
  assert xla_flags.apply({'JAX_PLATFORMS': 'cuda,cpu'}) == xla_flags.GPU_DEFAULTS
  for environ in ({'JAX_PLATFORMS': 'cpu'}, {'JAX_PLATFORMS': 'tpu'}):
    assert xla_flags.apply(environ) == () and 'XLA_FLAGS' not in environ
  monkeypatch.setattr(xla_flags, 'cuda_plugin_installed', lambda: False)
  environ = {}
  assert xla_flags.apply(environ) == () and environ == {}


def test_every_flag_the_ab_measures_is_known_to_xla():
  """XLA aborts on an unknown flag in XLA_FLAGS; GPU flags parse in the CPU build too."""
  flags = sorted({flag for flag_set in xla_flags.AB_FLAG_SETS.values() for flag in flag_set})
  assert len(flags) == 4
  code = 'import jax.numpy as jnp; print(int(jnp.ones(3).sum()))'
  for environ_flags, expected in ((' '.join(flags), 0), ('--xla_gpu_no_such_flag=1', 'fail')):
    process = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                             env=dict(os.environ, XLA_FLAGS=environ_flags, JAX_PLATFORMS='cpu'),
                             check=False)
    if expected == 0:
      assert process.returncode == 0 and process.stdout.strip() == '3', process.stderr[-2000:]
    else:  # The check can fail: an unknown flag is refused.
      assert process.returncode != 0 and 'xla_gpu_no_such_flag' in process.stderr
