"""Process and compiler set-up, in one place: what t2t_jax does to a process before JAX computes.

Every command and benchmark goes through `cli.run`, which calls `reexec_with_huge_pages` before
absl parses its flags and `start` once they are parsed. The library entries
(`train.train_and_evaluate`, `translator.Translator`, `dry_run.command`) call `start()` too, so
a program that imports t2t_jax gets the same set-up, as far as a running process still can
(the huge-page tunable needs a fresh process; XLA flags a backend not yet started).

- **Huge pages (CPU only).** XLA:CPU takes each step's large buffers from malloc, which maps big
  blocks afresh and unmaps them when freed: a Multi30k training step faulted in about 280 MB of
  4 KiB pages (370,000 page faults a second, 30% of the machine's CPU time in the kernel). With
  glibc's `glibc.malloc.hugetlb=1` those blocks come in 2 MiB pages: 100 times fewer faults and
  32% more updates a second (docs/performance.md). glibc reads its tunables when a process
  starts, so the command runs itself again with the tunable set. Only where the run will be on
  the CPU: it was never measured on GPU or TPU hosts. Logged once; T2T_JAX_HUGE_PAGES=0 turns
  it off.
- **XLA flags on NVIDIA GPUs** (`GPU_XLA_FLAGS`), added to XLA_FLAGS where a CUDA backend may
  start, never over a flag the user set; T2T_JAX_XLA_FLAGS=0 adds none.
- **libtpu on a machine without a TPU** (`apply_libtpu_env`): told it is one host, this one, so
  that JAX's attempt at a TPU backend fails for its real reason (no TPU) without an error line.
- **The persistent compilation cache** (`compilation_cache`).
- **The search's compiler options** (`jit_search`): beam and greedy search compile only
  through it, so no caller forgets them.
"""

import contextvars
import functools
import importlib.util
import glob
import os
import sys

from absl import logging
import jax
from jax._src import xla_bridge  # backends_are_initialized: whether XLA_FLAGS can still act.

HUGE_PAGES_SWITCH = 'T2T_JAX_HUGE_PAGES'  # '0' turns the huge-page re-exec off.
XLA_FLAGS_SWITCH = 'T2T_JAX_XLA_FLAGS'  # '0': t2t_jax adds no XLA flags (the A/B's children).
HUGE_PAGE_TUNABLE = 'glibc.malloc.hugetlb=1'
_SET_BY_US = 'T2T_JAX_HUGE_PAGES_SET'  # Marks a process (and its children) re-run with it.
_HELP = ('--help', '-h', '-?', '--helpfull', '--helpshort', '--helpxml')

# The XLA flags t2t_jax sets on NVIDIA GPUs, and the alternatives `bench/accelerator.py --xla_ab`
# measures against them, each in a process of its own: name -> flags.
#   --xla_gpu_enable_latency_hiding_scheduler=true  schedules collectives to overlap compute;
#       JAX's GPU performance tips and NVIDIA's JAX images set it. It matters on meshes of
#       several GPUs; on one GPU the A/B checks that it costs nothing.
#   --xla_gpu_enable_command_buffer=   (measured, not set) no CUDA graphs.
#   --xla_gpu_enable_triton_gemm=false (measured, not set) cuBLAS for every GEMM.
# docs/accelerators.md (XLA flags) says how the A/B is run, docs/results/ keeps its figures;
# change GPU_XLA_FLAGS only with a new A/B line.
GPU_XLA_FLAGS = ('--xla_gpu_enable_latency_hiding_scheduler=true',)
AB_FLAG_SETS = {
    'xla_defaults': (),
    't2t_defaults': GPU_XLA_FLAGS,
    'no_latency_hiding': ('--xla_gpu_enable_latency_hiding_scheduler=false',),
    'no_command_buffer': GPU_XLA_FLAGS + ('--xla_gpu_enable_command_buffer=',),
    'no_triton_gemm': GPU_XLA_FLAGS + ('--xla_gpu_enable_triton_gemm=false',),
}
_CUDA_PLUGINS = ('jax_cuda12_plugin', 'jax_cuda13_plugin')
DEFAULT_COMPILATION_CACHE = '~/.cache/t2t_jax/xla'


def reexec_with_huge_pages(argv: list[str], environ=os.environ) -> None:
  """Runs this command again (same pid, same arguments) with huge pages, where `huge_page_env`
  says so; returns where it does not. Call before anything allocates much."""
  if any(arg.split('=', 1)[0] in _HELP for arg in argv[1:]):
    return  # --help prints and exits: not worth a second start.
  rerun_env = huge_page_rerun_env(environ)
  if rerun_env is not None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable] + sys.orig_argv[1:], rerun_env)


def huge_page_rerun_env(environ=os.environ) -> dict | None:
  """`huge_page_env` on this machine: the environment a command would run itself again in,
  or None."""
  return huge_page_env(environ, _libc_version(), _transparent_huge_pages(),
                       _accelerator_possible(environ))


def huge_page_env(environ, libc_version: str | None, huge_pages: str | None,
                  accelerator: str | None = None) -> dict | None:
  """The environment to run this command again in, so that glibc's malloc asks for
  transparent huge pages; None where it already does, cannot, should not, or is told not to.

  It needs glibc 2.35 or later (`libc_version`, as os.confstr('CS_GNU_LIBC_VERSION') gives it)
  and transparent huge pages in 'always' or 'madvise' mode (`huge_pages`, the kernel's
  setting); `accelerator` names the GPU or TPU the run may use instead of the CPU (then None).
  A GLIBC_TUNABLES that sets glibc.malloc.hugetlb is left as it is.
  """
  tunables = environ.get('GLIBC_TUNABLES', '')
  if (environ.get(HUGE_PAGES_SWITCH, '1') == '0' or 'glibc.malloc.hugetlb' in tunables
      or accelerator):
    return None
  name, _, version = (libc_version or '').partition(' ')
  try:
    major, minor = (int(part) for part in version.split('.')[:2])
  except ValueError:
    return None
  if name != 'glibc' or (major, minor) < (2, 35):
    return None
  if not huge_pages or not ('[always]' in huge_pages or '[madvise]' in huge_pages):
    return None
  return {**environ, _SET_BY_US: '1',
          'GLIBC_TUNABLES': ':'.join(filter(None, (tunables, HUGE_PAGE_TUNABLE)))}


def _accelerator_possible(environ) -> str | None:
  """'gpu' or 'tpu' where JAX may pick one (a plugin and its device files are there), else None.

  Asked before JAX starts, so from what JAX_PLATFORMS says, or else from the files a backend
  would open, never by opening one.
  """
  platforms = [p for p in environ.get('JAX_PLATFORMS', '').split(',') if p]
  if platforms:
    return next((p for p in platforms if p != 'cpu'), None)
  if cuda_plugin_installed() and glob.glob('/dev/nvidia[0-9]*'):
    return 'gpu'
  if importlib.util.find_spec('libtpu') and _tpu_device_files():
    return 'tpu'
  return None


def _tpu_device_files() -> bool:
  """Whether this machine has the device files a TPU is opened through (/dev/accel* on TPU v2 to
  v4, /dev/vfio/N on v5 and later)."""
  return bool(glob.glob('/dev/accel*') or glob.glob('/dev/vfio/[0-9]*'))


def _libc_version() -> str | None:
  try:
    return os.confstr('CS_GNU_LIBC_VERSION')
  except (ValueError, OSError, AttributeError):
    return None


def _transparent_huge_pages() -> str | None:
  try:
    with open('/sys/kernel/mm/transparent_hugepage/enabled') as f:
      return f.read()
  except OSError:
    return None


def cuda_plugin_installed() -> bool:
  """Whether a jax CUDA plugin (jax[cuda12] or jax[cuda13]) is importable."""
  return any(importlib.util.find_spec(name) is not None for name in _CUDA_PLUGINS)


def merge_xla_flags(existing: str, flags: tuple[str, ...]) -> str:
  """`existing` XLA_FLAGS plus each of `flags` whose name it does not already set."""
  present = {part.split('=', 1)[0] for part in existing.split()}
  added = [flag for flag in flags if flag.split('=', 1)[0] not in present]
  return ' '.join(existing.split() + added)


def apply_xla_flags(environ=os.environ, flags: tuple[str, ...] = GPU_XLA_FLAGS
                    ) -> tuple[str, ...]:
  """Adds `flags` to environ['XLA_FLAGS'] when JAX may start a CUDA backend; returns those added.

  XLA reads the variable once, when JAX starts a backend: call this before.
  """
  platforms = environ.get('JAX_PLATFORMS', '')
  if (platforms and 'cuda' not in platforms and 'gpu' not in platforms) or (
      not cuda_plugin_installed()) or environ.get(XLA_FLAGS_SWITCH) == '0':
    return ()
  existing = environ.get('XLA_FLAGS', '')
  merged = merge_xla_flags(existing, flags)
  environ['XLA_FLAGS'] = merged
  return tuple(merged.split()[len(existing.split()):])


# What libtpu reads about the slice it runs in, from the environment or else a TPU VM's metadata
# server. Where the user set any of them, t2t_jax sets none.
LIBTPU_TOPOLOGY_VARIABLES = ('TPU_WORKER_HOSTNAMES', 'TPU_PROCESS_ADDRESSES', 'TPU_WORKER_ID',
                              'TPU_ACCELERATOR_TYPE', 'TPU_HOST_BOUNDS',
                              'TPU_CHIPS_PER_HOST_BOUNDS', 'TPU_TOPOLOGY')
# A machine without a TPU, described to libtpu: one host, and that host is this one.
NO_TPU_LIBTPU_ENV = {'TPU_WORKER_HOSTNAMES': 'localhost', 'TPU_HOST_BOUNDS': '1,1,1'}


def apply_libtpu_env(environ=os.environ) -> tuple[str, ...]:
  """Sets `NO_TPU_LIBTPU_ENV` in environ where libtpu is installed, JAX may try a TPU backend
  and this machine has no TPU; returns the names set.

  With libtpu installed, JAX tries a TPU backend before it falls back to the CPU. On a machine
  without TPU chips JAX sets TPU_SKIP_MDS_QUERY=1 (jax/_src/cloud_tpu_init.py), so libtpu does
  not ask the GCE metadata server for the slice; it then takes its "WARNING: could not
  determine ..." text as the worker hostnames and accelerator type, and prints two errors
  parsing them ("unexpected worker hostname", "Failed to find host bounds") before failing for
  the real reason, no TPU device, which JAX logs at INFO. Told one host, this one, it fails for
  that reason alone. Compiling for a TPU target (`compile/targets.py`) is unchanged: its topology
  comes from the target. libtpu reads the variables when JAX starts its backend: call this
  before. Where JAX_PLATFORMS is set, JAX_FORCE_TPU_INIT asks for a TPU, or the user set any
  of libtpu's topology variables, it sets nothing.
  """
  if (environ.get('JAX_PLATFORMS') or 'JAX_FORCE_TPU_INIT' in environ
      or any(name in environ for name in LIBTPU_TOPOLOGY_VARIABLES)
      or not _libtpu_installed(environ) or _tpu_device_files()):
    return ()
  environ.update(NO_TPU_LIBTPU_ENV)
  return tuple(NO_TPU_LIBTPU_ENV)


# JAX's CUDA plugin checks, when JAX starts, that the CUDA libraries it was built against load.
CUDA_CHECK_SWITCH = 'JAX_SKIP_CUDA_CONSTRAINTS_CHECK'


def apply_cuda_env(environ=os.environ) -> tuple[str, ...]:
  """Sets CUDA_CHECK_SWITCH=1 in environ where a CUDA plugin is installed but this machine has
  no NVIDIA GPU (no /dev/nvidiaN); returns the names set.

  The plugin's check needs the CUDA runtime, which the `gpu-compile` extra (compiling for GPU
  targets on a CPU) leaves out: it fails, JAX logs the failure as an error at every start and
  leaves the plugin out, so a GPU target's compile-only devices are refused as if the plugin
  were missing. With no GPU there is nothing for the check to guard. Where the user set the
  variable, it is left as it is. Read when JAX starts its backends: call this before.
  """
  if (CUDA_CHECK_SWITCH in environ or not cuda_plugin_installed()
      or glob.glob('/dev/nvidia[0-9]*')):
    return ()
  environ[CUDA_CHECK_SWITCH] = '1'
  return (CUDA_CHECK_SWITCH,)


def _libtpu_installed(environ) -> bool:
  """Whether JAX would find a libtpu to load (jax/_src/cloud_tpu_init.get_tpu_library_path)."""
  return bool(environ.get('TPU_LIBRARY_PATH')) or importlib.util.find_spec('libtpu') is not None


# JAX's own variable for the shortest compile worth keeping: where it is set, it wins over
# t2t_jax's default (the test suite sets 0.5 for the commands it starts, as for itself).
MIN_COMPILE_SECONDS_VARIABLE = 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'


def compilation_cache(directory: str, min_compile_seconds: float | None = None) -> None:
  """Keeps compiled programs in `directory` (across processes); an empty one turns it off.

  `min_compile_seconds`: programs that compile faster are not kept; None is
  $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS where set, else 1 second.
  """
  if not directory:
    jax.config.update('jax_enable_compilation_cache', False)
    return
  if min_compile_seconds is None:
    min_compile_seconds = float(os.environ.get(MIN_COMPILE_SECONDS_VARIABLE) or 1.0)
  jax.config.update('jax_compilation_cache_dir', os.path.expanduser(directory))
  jax.config.update('jax_persistent_cache_min_compile_time_secs', min_compile_seconds)


def start(cache_directory: str | None = None) -> None:
  """The process set-up that can still happen in a running process; once per process.

  `cache_directory`: the persistent compilation cache (`compilation_cache`); None leaves
  JAX's setting as it is (a library caller's own).
  """
  if cache_directory is not None:
    compilation_cache(cache_directory)
  _start_once()


@functools.cache
def _start_once() -> None:
  if xla_bridge.backends_are_initialized():
    if apply_xla_flags(dict(os.environ)):  # A copy: only to learn what would have been added.
      logging.warning('JAX started its backend before t2t_jax.runtime.start(), so the XLA '
                      'flags t2t_jax sets on GPUs (%s) are not in effect: call start() before '
                      'the first JAX computation', ' '.join(GPU_XLA_FLAGS))
  else:
    if added := apply_xla_flags():
      logging.info('XLA flags for NVIDIA GPUs added to XLA_FLAGS: %s', ' '.join(added))
    if apply_cuda_env():
      logging.info('No NVIDIA GPU on this machine: %s=1, so JAX\'s CUDA plugin loads for '
                   'compiling without the CUDA runtime (docs/accelerators.md)', CUDA_CHECK_SWITCH)
    if told := apply_libtpu_env():
      logging.info('No TPU on this machine: libtpu is told it is one host (%s), so that JAX '
                   'falls back to the CPU without libtpu errors (docs/accelerators.md)',
                   ' '.join(f'{name}={os.environ[name]}' for name in told))
  if os.environ.get(_SET_BY_US) == '1' and HUGE_PAGE_TUNABLE in os.environ.get(
      'GLIBC_TUNABLES', ''):
    logging.info('malloc takes transparent huge pages on this CPU run (GLIBC_TUNABLES=%s, '
                 'docs/performance.md); %s=0 turns it off', HUGE_PAGE_TUNABLE,
                 HUGE_PAGES_SWITCH)


def search_compiler_options(platform: str | None = None) -> dict:
  """The XLA options t2t_jax compiles its searches with on `platform` (default: JAX's).

  On CPU: copy insertion with region analysis. Without it XLA:CPU copies every layer's
  self-attention cache at every step of beam search, although the step reads the cache it
  was handed before updating it in place; with it, the update happens in place.
  docs/performance.md has the measurement.
  """
  if (platform or jax.default_backend()) != 'cpu':
    return {}
  return {'xla_cpu_copy_insertion_use_region_analysis': True}


# Weight bytes from which a one-device CPU train step compiles with region analysis
# (train_compiler_options).
CPU_IN_PLACE_WEIGHT_BYTES = 64 << 20


def train_compiler_options(mesh_config, platform: str, scatter_devices: int = 1,
                           weight_bytes: int = 0) -> dict:
  """The XLA options the train step compiles with on `platform` ('gpu', 'tpu', 'cpu'): on
  GPUs, the combine thresholds of config.mesh.collective_combine_bytes (when above 0); on
  the CPU, the searches' copy insertion with region analysis (search_compiler_options) for a
  one-device step whose weights, `weight_bytes` (0 on a larger mesh), reach
  CPU_IN_PLACE_WEIGHT_BYTES; else none.

  The GPU setting caps the bytes of whole arrays one combined collective carries: the gradients
  going into a reduce-scatter, the weights coming out of an all-gather, the arrays of an
  all-reduce. XLA measures each kind by its result, which for a reduce-scatter is the
  scattered share, so its threshold is the cap over `scatter_devices` (the devices a gradient
  is scattered across: the mesh's 'fsdp' axis, times 'data' with mesh.shard_update).

  On one CPU device XLA's usual copy insertion copies every donated weight at the step's
  start, as it cannot tell that the backward pass reads a weight before the update
  overwrites it in place (128 copies for the paper's base model); with region analysis the
  update writes in place. That made base's step 9% faster and smaller models' up to 4%
  slower, hence the threshold; docs/performance.md has the measurements.
  """
  if platform == 'cpu':
    return search_compiler_options('cpu') if weight_bytes >= CPU_IN_PLACE_WEIGHT_BYTES else {}
  size = int(mesh_config.get('collective_combine_bytes', 0))
  if platform != 'gpu' or size <= 0:
    return {}
  return {'xla_gpu_reduce_scatter_combine_threshold_bytes': max(1, size // scatter_devices),
          'xla_gpu_all_gather_combine_threshold_bytes': size,
          'xla_gpu_all_reduce_combine_threshold_bytes': size}


_IN_JIT_SEARCH = contextvars.ContextVar('t2t_jax_in_jit_search', default=False)


def jit_search(search, platform: str | None = None, **jit_kwargs):
  """`jax.jit(search, ...)` with the search's compiler options for `platform` (default: JAX's
  backend): the one way t2t_jax compiles `decode.greedy_search`, `decode.beam_search` or a
  function that calls them. `jit_kwargs` go to jax.jit (shardings, static arguments)."""

  @functools.wraps(search)
  def traced(*args, **kwargs):
    token = _IN_JIT_SEARCH.set(True)
    try:
      return search(*args, **kwargs)
    finally:
      _IN_JIT_SEARCH.reset(token)

  traced.__name__ = _name(search)  # The program's name, as jax.jit(search) would give it.
  return jax.jit(traced, compiler_options=search_compiler_options(platform) or None,
                 **jit_kwargs)


def _name(function) -> str:
  while isinstance(function, functools.partial):
    function = function.func
  return getattr(function, '__name__', 'search')


def check_search_compiled_here(name: str) -> None:
  """Called by the searches as they are traced: warns, once, where one is compiled without
  `jit_search` on a platform whose options it would miss."""
  if not _IN_JIT_SEARCH.get() and search_compiler_options():
    _warn_search_options(name)


@functools.cache
def _warn_search_options(name: str) -> None:
  logging.warning('decode.%s is being compiled without t2t_jax.runtime.jit_search, so without '
                  'its compiler options %s: on this CPU every beam-search step then copies '
                  'the caches. Compile it with runtime.jit_search(...) instead of jax.jit.',
                  name, search_compiler_options())
