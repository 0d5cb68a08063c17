"""The XLA flags t2t_jax sets on NVIDIA GPUs: the one place they live.

XLA reads XLA_FLAGS once, when JAX starts a backend, so `apply()` must run before the first
JAX computation (and before `jax.devices()`): t2t_jax/main.py calls it first thing in `main`.
A flag the user already put in XLA_FLAGS is left as the user set it. Nothing is set where no
CUDA plugin is installed or JAX_PLATFORMS leaves CUDA out, so CPU and TPU runs are untouched.

The defaults and the alternatives `bench/accelerator.py --xla_ab` measures against them:

  --xla_gpu_enable_latency_hiding_scheduler=true   schedules collectives to overlap compute;
      JAX's GPU performance tips and NVIDIA's JAX images set it. It matters on meshes of
      several GPUs; on one GPU the A/B checks that it costs nothing.
  --xla_gpu_enable_command_buffer=                 (measured, not set) no CUDA graphs.
  --xla_gpu_enable_triton_gemm=false               (measured, not set) cuBLAS for every GEMM.

docs/accelerators.md keeps the A/B's figures; change GPU_DEFAULTS only with a new A/B line.
"""

import importlib.util
import os

GPU_DEFAULTS = ('--xla_gpu_enable_latency_hiding_scheduler=true',)

# Flag sets bench/accelerator.py measures, each in a process of its own: name -> flags.
AB_FLAG_SETS = {
    'xla_defaults': (),
    't2t_defaults': GPU_DEFAULTS,
    'no_latency_hiding': ('--xla_gpu_enable_latency_hiding_scheduler=false',),
    'no_command_buffer': GPU_DEFAULTS + ('--xla_gpu_enable_command_buffer=',),
    'no_triton_gemm': GPU_DEFAULTS + ('--xla_gpu_enable_triton_gemm=false',),
}

_CUDA_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin')


def cuda_plugin_installed() -> bool:
  """Whether a jax CUDA plugin (jax[cuda12] or jax[cuda13]) is importable."""
  return any(importlib.util.find_spec(name) is not None for name in _CUDA_PLUGINS)


def merge(existing: str, flags: tuple[str, ...]) -> str:
  """`existing` XLA_FLAGS plus each of `flags` whose name it does not already set."""
  present = {part.split('=', 1)[0] for part in existing.split()}
  added = [flag for flag in flags if flag.split('=', 1)[0] not in present]
  return ' '.join(existing.split() + added)


def apply(environ=os.environ, flags: tuple[str, ...] = GPU_DEFAULTS) -> tuple[str, ...]:
  """Adds `flags` to environ['XLA_FLAGS'] when JAX may start a CUDA backend; returns those added.

  Call before JAX starts a backend: XLA reads the variable once, at that moment.
  """
  platforms = environ.get('JAX_PLATFORMS', '')
  if (platforms and 'cuda' not in platforms and 'gpu' not in platforms) or (
      not cuda_plugin_installed()):
    return ()
  existing = environ.get('XLA_FLAGS', '')
  merged = merge(existing, flags)
  environ['XLA_FLAGS'] = merged
  return tuple(merged.split()[len(existing.split()):])
