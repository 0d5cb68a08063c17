"""t2t_jax/runtime.py: the huge-page re-exec only on CPU runs, logged once; GPU XLA flags only where
a CUDA backend may start, never over the user's own; libtpu told it is one host where there is
no TPU, so a CPU run starts without an error line; the compilation cache; the search's compiler
options applied by the one function every search compiles through. That every command starts
through cli.run is checked in tests/test_architecture.py."""

import logging
import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from t2t_jax import runtime

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize('environ, libc, huge_pages, accelerator, expected', [
    ({}, 'glibc 2.36', 'always [madvise] never', None, 'glibc.malloc.hugetlb=1'),
    ({}, 'glibc 2.35', '[always] madvise never', None, 'glibc.malloc.hugetlb=1'),
    ({'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}, 'glibc 2.40', 'always [madvise] never', None,
     'glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1'),  # The user's tunables are kept.
    ({}, 'glibc 2.34', 'always [madvise] never', None, None),  # No such tunable before 2.35.
    ({}, 'glibc 2.36', 'always madvise [never]', None, None),  # The kernel gives none.
    ({}, None, 'always [madvise] never', None, None),  # Not glibc (musl, macOS).
    ({}, 'glibc 2.36', None, None, None),  # No transparent huge pages (not Linux).
    ({'T2T_JAX_HUGE_PAGES': '0'}, 'glibc 2.36', 'always [madvise] never', None, None),
    ({'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=0'}, 'glibc 2.36', 'always [madvise] never', None,
     None),  # The user chose.
    ({}, 'glibc 2.36', 'always [madvise] never', 'gpu', None),  # Never measured there.
    ({}, 'glibc 2.36', 'always [madvise] never', 'tpu', None),
])
def test_huge_page_env_asks_glibc_for_huge_pages_only_on_cpu_where_it_can(
    environ, libc, huge_pages, accelerator, expected):
  env = runtime.huge_page_env({'PATH': '/bin', **environ}, libc, huge_pages, accelerator)
  if expected is None:
    assert env is None
  else:
    assert env == {'PATH': '/bin', **environ, 'GLIBC_TUNABLES': expected,
                   'T2T_JAX_HUGE_PAGES_SET': '1'}


def test_an_accelerator_is_told_from_jax_platforms_or_the_device_files(monkeypatch):
  possible = runtime._accelerator_possible  # pylint: disable=protected-access
  assert possible({'JAX_PLATFORMS': 'cpu'}) is None
  assert possible({'JAX_PLATFORMS': 'cuda,cpu'}) == 'cuda'
  assert possible({'JAX_PLATFORMS': 'tpu'}) == 'tpu'
  device_files = {'/dev/nvidia[0-9]*': ['/dev/nvidia0'], '/dev/accel*': [],
                  '/dev/vfio/[0-9]*': []}
  monkeypatch.setattr(runtime.glob, 'glob', lambda pattern: device_files.get(pattern, []))
  monkeypatch.setattr(runtime, 'cuda_plugin_installed', lambda: True)
  assert possible({}) == 'gpu'
  monkeypatch.setattr(runtime, 'cuda_plugin_installed', lambda: False)  # Files, no plugin.
  assert possible({}) is None
  device_files['/dev/accel*'] = ['/dev/accel0']
  monkeypatch.setattr(runtime.importlib.util, 'find_spec', lambda name: name == 'libtpu')
  assert possible({}) == 'tpu'
  monkeypatch.setattr(runtime.importlib.util, 'find_spec', lambda name: None)  # No libtpu.
  assert possible({}) is None


def _huge_pages_here() -> bool:
  return runtime.huge_page_env({}, runtime._libc_version(),  # pylint: disable=protected-access
                               runtime._transparent_huge_pages()) is not None  # pylint: disable=protected-access


_SHOW = ('import os; from t2t_jax import cli; cli.run(lambda argv: print(argv[1:], '
         'os.environ.get("GLIBC_TUNABLES"), os.getpid()))')


@pytest.mark.slow
@pytest.mark.parametrize('switch, platforms, expected', [
    ('1', 'cpu', 'glibc.malloc.hugetlb=1'), ('0', 'cpu', 'None'), ('1', 'cuda', 'None')])
def test_commands_run_again_with_huge_pages_on_cpu_keeping_their_arguments(switch, platforms,
                                                                           expected):
  if expected != 'None' and not _huge_pages_here():
    pytest.skip('this machine has no glibc 2.35+ with transparent huge pages')
  env = {k: v for k, v in os.environ.items() if not k.startswith(('GLIBC_TUNABLES', 'T2T_JAX'))}
  process = subprocess.Popen([sys.executable, '-c', _SHOW, 'extra', '--verbose'], cwd=ROOT,
                             env={**env, 'T2T_JAX_HUGE_PAGES': switch, 'JAX_PLATFORMS': platforms},
                             text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  out, err = process.communicate(timeout=120)
  assert process.returncode == 0, err
  # The same process (exec keeps the pid), its arguments intact, the tunable set once.
  assert out.strip() == f"['extra'] {expected} {process.pid}"
  # Said once, with its off switch, where it was set; not a word where it was not.
  said = re.findall(r'transparent huge pages.*T2T_JAX_HUGE_PAGES=0 turns it off', err)
  assert len(said) == (1 if expected != 'None' else 0), err


def test_help_is_not_worth_a_second_start(monkeypatch):
  execs = []
  monkeypatch.setattr(runtime, 'huge_page_env', lambda *args: {'GLIBC_TUNABLES': 'x'})
  monkeypatch.setattr(runtime.os, 'execve', lambda *args: execs.append(args[1]))
  for argv in (['prog', '--help'], ['prog', '--config=c.py', '-h'], ['prog', '--helpfull']):
    runtime.reexec_with_huge_pages(argv)
  assert not execs
  runtime.reexec_with_huge_pages(['prog', '--config=c.py'])
  assert len(execs) == 1


def test_merge_keeps_what_the_user_set_and_adds_the_rest():
  merged = runtime.merge_xla_flags('--xla_gpu_enable_latency_hiding_scheduler=false --foo=1',
                                   ('--xla_gpu_enable_latency_hiding_scheduler=true',
                                    '--xla_gpu_enable_triton_gemm=false'))
  assert merged.split() == ['--xla_gpu_enable_latency_hiding_scheduler=false', '--foo=1',
                            '--xla_gpu_enable_triton_gemm=false']
  assert runtime.merge_xla_flags('', ()) == ''


def test_xla_flags_are_set_only_where_cuda_may_start(monkeypatch):
  monkeypatch.setattr(runtime, 'cuda_plugin_installed', lambda: True)
  environ = {'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}
  assert runtime.apply_xla_flags(environ) == runtime.GPU_XLA_FLAGS
  assert environ['XLA_FLAGS'].split() == ['--xla_force_host_platform_device_count=8',
                                          *runtime.GPU_XLA_FLAGS]
  assert runtime.apply_xla_flags(environ) == ()  # A second call adds nothing.
  assert runtime.apply_xla_flags({'JAX_PLATFORMS': 'cuda,cpu'}) == runtime.GPU_XLA_FLAGS
  for environ in ({'JAX_PLATFORMS': 'cpu'}, {'JAX_PLATFORMS': 'tpu'},
                  {'T2T_JAX_XLA_FLAGS': '0'}):  # The switch: exactly the user's flags.
    assert runtime.apply_xla_flags(environ) == () and 'XLA_FLAGS' not in environ
  monkeypatch.setattr(runtime, 'cuda_plugin_installed', lambda: False)
  environ = {}
  assert runtime.apply_xla_flags(environ) == () and environ == {}


@pytest.mark.slow
def test_every_flag_the_ab_measures_is_known_to_xla():
  """XLA aborts on an unknown flag in XLA_FLAGS; GPU flags parse in the CPU build too."""
  flags = sorted({flag for flag_set in runtime.AB_FLAG_SETS.values() for flag in flag_set})
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


def test_libtpu_is_told_one_host_only_where_it_would_otherwise_fail_loudly(monkeypatch):
  monkeypatch.setattr(runtime, '_tpu_device_files', lambda: False)
  monkeypatch.setattr(runtime.importlib.util, 'find_spec', lambda name: name == 'libtpu')
  environ = {'PATH': '/bin'}
  assert runtime.apply_libtpu_env(environ) == tuple(runtime.NO_TPU_LIBTPU_ENV)
  assert environ == {'PATH': '/bin', **runtime.NO_TPU_LIBTPU_ENV}
  for environ in ({'JAX_PLATFORMS': 'cpu'},  # No TPU backend is tried.
                  {'JAX_PLATFORMS': 'tpu'},  # The user asks for a TPU: libtpu should say why not.
                  {'JAX_FORCE_TPU_INIT': '1'},
                  {'TPU_WORKER_HOSTNAMES': 'host-a,host-b'},  # The user's own, and its siblings
                  {'TPU_ACCELERATOR_TYPE': 'v5litepod-8'}):  # are left unset beside it.
    before = dict(environ)
    assert runtime.apply_libtpu_env(environ) == () and environ == before
  monkeypatch.setattr(runtime, '_tpu_device_files', lambda: True)  # A TPU VM.
  assert runtime.apply_libtpu_env({}) == ()
  monkeypatch.setattr(runtime, '_tpu_device_files', lambda: False)
  monkeypatch.setattr(runtime.importlib.util, 'find_spec', lambda name: None)  # No libtpu.
  assert runtime.apply_libtpu_env({}) == ()
  assert runtime.apply_libtpu_env({'TPU_LIBRARY_PATH': '/opt/libtpu.so'}) == tuple(
      runtime.NO_TPU_LIBTPU_ENV)


def test_the_cuda_plugins_check_is_skipped_only_without_a_gpu(monkeypatch):
  monkeypatch.setattr(runtime, 'cuda_plugin_installed', lambda: True)
  monkeypatch.setattr(runtime.glob, 'glob', lambda pattern: [])  # No /dev/nvidiaN.
  environ = {'PATH': '/bin'}
  assert runtime.apply_cuda_env(environ) == (runtime.CUDA_CHECK_SWITCH,)
  assert environ == {'PATH': '/bin', runtime.CUDA_CHECK_SWITCH: '1'}
  mine = {runtime.CUDA_CHECK_SWITCH: '0'}  # The user's own setting stays.
  assert runtime.apply_cuda_env(mine) == () and mine == {runtime.CUDA_CHECK_SWITCH: '0'}
  monkeypatch.setattr(runtime.glob, 'glob', lambda pattern: ['/dev/nvidia0'])  # A GPU host.
  assert runtime.apply_cuda_env({}) == ()
  monkeypatch.setattr(runtime.glob, 'glob', lambda pattern: [])
  monkeypatch.setattr(runtime, 'cuda_plugin_installed', lambda: False)
  assert runtime.apply_cuda_env({}) == ()


_ERROR_LINE = re.compile(r'^E\d{4} ', re.MULTILINE)  # glog's error lines: E<month><day> ...


@pytest.mark.slow
@pytest.mark.parametrize('target', ['', 'tpu:v5e-8'])
def test_a_cpu_run_with_libtpu_installed_starts_without_an_error_line(libtpu, target):
  """As on a CPU machine with the `tpu` extra: JAX_PLATFORMS unset, so JAX tries libtpu; the
  compile-only TPU target still compiles."""
  del libtpu
  accelerator = runtime._accelerator_possible({})  # pylint: disable=protected-access
  if accelerator:
    pytest.skip(f'this machine has a {accelerator}: the run would open it')
  # As a user's shell has it: none of what the suite or t2t_jax sets for the run. Where JAX's
  # CUDA plugin is installed without the CUDA runtime (the `gpu-compile` extra), the command
  # itself turns off the plugin's check, which would otherwise log an error at every start.
  # Nor what an earlier test's TPU compile left in this worker's environment
  # (targets.prepare_libtpu sets libtpu's topology variables, which the run would then take
  # as the user's own and leave alone).
  env = {k: v for k, v in os.environ.items()
         if k not in ('JAX_PLATFORMS', runtime.CUDA_CHECK_SWITCH, 'TPU_SKIP_MDS_QUERY',
                      'ALLOW_MULTIPLE_LIBTPU_LOAD')
         and k not in runtime.NO_TPU_LIBTPU_ENV and k not in runtime.LIBTPU_TOPOLOGY_VARIABLES}
  command = [sys.executable, '-m', 't2t_jax.main', '--config=configs/tiny.py', '--dry_run']
  run = subprocess.run(command + ([f'--dry_run_target={target}'] if target else []), cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  assert '"compiled_flops_per_device"' in run.stdout.splitlines()[-1]
  assert not _ERROR_LINE.findall(run.stderr), run.stderr[-3000:]
  assert 'could not determine' not in run.stderr, run.stderr[-3000:]  # libtpu's placeholders.
  assert 'plugin configuration error' not in run.stderr, run.stderr[-3000:]  # CUDA's check.


def test_start_after_the_backend_warns_that_gpu_flags_missed_it(monkeypatch, caplog):
  jax.devices()  # The backend is up, as in a program that computed before calling start().
  monkeypatch.setattr(runtime, 'cuda_plugin_installed', lambda: True)
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  runtime._start_once.cache_clear()  # pylint: disable=protected-access
  before = os.environ.get('XLA_FLAGS')
  with caplog.at_level(logging.INFO):
    runtime.start()
    runtime.start()  # Once per process.
  runtime._start_once.cache_clear()  # pylint: disable=protected-access
  assert os.environ.get('XLA_FLAGS') == before  # Too late: nothing is pretended.
  said = [r.getMessage() for r in caplog.records if 'are not in effect' in r.getMessage()]
  assert len(said) == 1 and runtime.GPU_XLA_FLAGS[0] in said[0]


def test_compilation_cache_goes_where_asked_and_off_when_empty(tmp_path):
  names = ('jax_compilation_cache_dir', 'jax_enable_compilation_cache',
           'jax_persistent_cache_min_compile_time_secs')
  before = {name: getattr(jax.config, name) for name in names}
  try:
    with pytest.MonkeyPatch.context() as patch:
      patch.delenv(runtime.MIN_COMPILE_SECONDS_VARIABLE, raising=False)
      runtime.compilation_cache(str(tmp_path / 'xla'))
      assert jax.config.jax_compilation_cache_dir == str(tmp_path / 'xla')
      assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
      patch.setenv(runtime.MIN_COMPILE_SECONDS_VARIABLE, '0.25')  # JAX's variable wins.
      runtime.compilation_cache(str(tmp_path / 'xla'))
      assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.25
    runtime.compilation_cache('')
    assert jax.config.jax_enable_compilation_cache is False
  finally:
    for name, value in before.items():
      jax.config.update(name, value)


def test_jit_search_keeps_the_program_name_and_static_arguments():
  def search(x, count):
    return x * count
  jitted = runtime.jit_search(search, static_argnames=('count',))
  assert float(jitted(jnp.float32(2), count=3)) == 6.0
  assert 'jit_search' in jitted.lower(jnp.float32(2), count=3).as_text()


def test_a_search_traced_without_jit_search_warns_once_on_cpu(caplog):
  from t2t_jax.decoding import decode  # pylint: disable=g-import-not-at-top
  runtime._warn_search_options.cache_clear()  # pylint: disable=protected-access
  with caplog.at_level(logging.WARNING):
    runtime.check_search_compiled_here('beam_search')
    runtime.check_search_compiled_here('beam_search')
    runtime.jit_search(lambda: runtime.check_search_compiled_here('greedy_search'))()
  warned = [r.getMessage() for r in caplog.records if 'without t2t_jax.runtime.jit_search' in
            r.getMessage()]
  assert len(warned) == 1 and 'decode.beam_search' in warned[0], warned
  assert decode.beam_search.__module__ == 't2t_jax.decoding.decode'
  runtime._warn_search_options.cache_clear()  # pylint: disable=protected-access



def test_a_one_device_cpu_step_takes_region_analysis_from_64_mib_of_weights():
  """The searches' copy insertion for a CPU train step with CPU_IN_PLACE_WEIGHT_BYTES of
  weights (build passes 0 on a larger mesh), whatever the mesh config; none below it, and
  none on a TPU."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  mesh = ml_collections.ConfigDict({'collective_combine_bytes': 8 << 20})
  large = runtime.CPU_IN_PLACE_WEIGHT_BYTES
  assert large == 64 << 20
  assert runtime.train_compiler_options(mesh, 'cpu', weight_bytes=large) == (
      runtime.search_compiler_options('cpu')) == {
          'xla_cpu_copy_insertion_use_region_analysis': True}
  assert runtime.train_compiler_options(mesh, 'cpu', weight_bytes=large - 1) == {}
  assert runtime.train_compiler_options(mesh, 'tpu', weight_bytes=large) == {}


def test_collective_combine_bytes_become_gpu_compiler_options_xla_knows():
  """mesh.collective_combine_bytes gives the train step three XLA options on GPUs only, none
  at 0, the reduce-scatters' over the devices a gradient is scattered across (XLA counts a
  reduce-scatter by its scattered result); XLA (whose CPU build parses GPU options too)
  accepts them: an unknown one raises."""
  import ml_collections  # pylint: disable=g-import-not-at-top
  mesh = ml_collections.ConfigDict({'collective_combine_bytes': 8 << 20})
  options = runtime.train_compiler_options(mesh, 'gpu', scatter_devices=8)
  assert options == {'xla_gpu_reduce_scatter_combine_threshold_bytes': 1 << 20,
                     'xla_gpu_all_gather_combine_threshold_bytes': 8 << 20,
                     'xla_gpu_all_reduce_combine_threshold_bytes': 8 << 20}
  assert runtime.train_compiler_options(mesh, 'gpu')[
      'xla_gpu_reduce_scatter_combine_threshold_bytes'] == 8 << 20  # No FSDP: nothing split.
  assert runtime.train_compiler_options(mesh, 'tpu') == {}
  assert runtime.train_compiler_options(mesh, 'cpu') == {}
  assert runtime.train_compiler_options(ml_collections.ConfigDict(
      {'collective_combine_bytes': 0}), 'gpu') == {}
  assert int(jax.jit(lambda x: x.sum(), compiler_options=options)(jnp.ones(3))) == 3
  with pytest.raises(Exception, match='xla_gpu_no_such_threshold'):
    jax.jit(lambda x: x.sum() + 1, compiler_options={'xla_gpu_no_such_threshold': 1})(
        jnp.ones(3))
