"""Eight simulated CPU devices and a persistent compilation cache, set before jax loads.

The suite runs on the CPU backend, also on a machine with a GPU. T2T_TEST_GPU=1 runs the tests
marked `gpu` instead, on the GPU with t2t_jax's XLA flags; either way the others are skipped
with the reason (docs/development.md).
"""

import functools
import importlib.util
import os
import sys

os.environ['XLA_FLAGS'] = (os.environ.get('XLA_FLAGS', '') +
                           ' --xla_force_host_platform_device_count=8')
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # `configs` is importable from a plain checkout too.
GPU_RUN = os.environ.get('T2T_TEST_GPU') == '1'
if GPU_RUN:
  from t2t_jax import runtime  # pylint: disable=g-import-not-at-top
  runtime.apply_xla_flags()
else:  # Subprocesses inherit it: they too see only the CPU.
  os.environ['JAX_PLATFORMS'] = 'cpu'
  # The GPU compile tests' plugin without the CUDA runtime, as the commands set it.
  from t2t_jax import runtime  # pylint: disable=g-import-not-at-top
  runtime.apply_cuda_env()
  # The commands the tests start begin in the environment they would run themselves again in
  # (huge pages, runtime.reexec_with_huge_pages), so each starts once: the second start's
  # imports cost 2-4 s a command here. tests/test_runtime.py checks the re-run itself in
  # processes without it.
  os.environ.update(runtime.huge_page_rerun_env() or {})

CACHE_DIR = os.path.expanduser(os.environ.get('T2T_JAX_TEST_CACHE', '~/.cache/t2t_jax/xla'))
# The same persistent compilation cache for every process the tests start (they inherit the
# environment): `python -m t2t_jax.*` runs, `python -c` scripts and launch/local.py's workers
# compile the tiny programs once per machine, not once per test (the commands honour the
# variable over their own 1 s). Not 0, which would also keep the small eager operations
# each process compiles (PRNG splits, array conversions): JAX writes an entry in place, and with
# eviction off (its default) without a lock, so many processes writing the same small entries
# at once could read one half-written.
os.environ['JAX_COMPILATION_CACHE_DIR'] = CACHE_DIR
os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS'] = '0.5'

import numpy as np  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

jax.config.update('jax_compilation_cache_dir', CACHE_DIR)
jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)


def load_script(relative_path: str):
  """The module of a script that is not in a package (bench/, .ci/), by its path under ROOT."""
  name = os.path.splitext(os.path.basename(relative_path))[0]
  spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, relative_path))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def pytest_collection_modifyitems(items):
  # The longest test first: under `-n 2 --dist=worksteal` (the README's command) one worker
  # starts it at once while the other takes the rest, and then steals from the first's queue.
  items.sort(key=lambda item: not item.nodeid.startswith('tests/test_quick_start.py'))
  for item in items:
    if 'gpu' in item.keywords and not GPU_RUN:
      item.add_marker(pytest.mark.skip(reason='a GPU test: run T2T_TEST_GPU=1 python -m pytest '
                                       '-m gpu tests on a machine with a GPU'))
    elif GPU_RUN and 'gpu' not in item.keywords:
      item.add_marker(pytest.mark.skip(reason='T2T_TEST_GPU=1 runs only the gpu tests; the '
                                       'others need the 8 simulated CPU devices: run without it'))


@pytest.fixture
def gpu_device():
  """The first GPU; the test is skipped where there is none."""
  gpus = [device for device in jax.devices() if device.platform == 'gpu']
  if not gpus:
    pytest.skip(f'no GPU here: jax.devices() is {jax.devices()}')
  return gpus[0]


@pytest.fixture
def tiny_config():
  from configs import tiny  # pylint: disable=g-import-not-at-top
  return tiny.get_config()


@pytest.fixture(scope='session')
def tiny_run(tmp_path_factory):
  """The tiny config trained to step 20 once per session: (workdir, final figures). Tests read
  it; one that trains on, damages or resumes it works on a copy."""
  from configs import tiny  # pylint: disable=g-import-not-at-top
  from t2t_jax.training import train  # pylint: disable=g-import-not-at-top
  workdir = str(tmp_path_factory.mktemp('tiny_run'))
  return workdir, train.train_and_evaluate(tiny.get_config(), workdir)


# The options of the programs a test compiles only to compare their results (not to time or
# inspect them): LLVM's optimisations off, XLA's own passes as ever. The tiny models' programs
# compile in about 40% less time; they compute the same operations, within float32 rounding
# of the optimised build's (a loop may sum in another order).
QUICK_COMPILE = {'xla_backend_optimization_level': 0}


def quick_jit(function, **jit_kwargs):
  """`jax.jit(function, **jit_kwargs)` compiled with QUICK_COMPILE."""
  return jax.jit(function, compiler_options=QUICK_COMPILE, **jit_kwargs)


def attention_inputs(batch, queries, keys, heads, head_dim, seed=0):
  """Scaled queries [B, Q, H, D] (as attention._Attention._queries gives them), keys, values:
  float32 normal draws of `seed`."""
  rng = np.random.default_rng(seed)
  normal = lambda length: jax.numpy.asarray(rng.normal(size=(batch, length, heads, head_dim)),
                                            np.float32)
  return normal(queries) * head_dim**-0.5, normal(keys), normal(keys)


def assert_close_to_scale(actual, expected, tolerance, where=None):
  """Every array's largest difference (at `where`, [B, Q] rows) within `tolerance` of its
  largest value there."""
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
    if where is not None:
      a, e = a[where], e[where]
    error, scale = np.abs(a - e).max(), np.abs(e).max()
    assert error <= tolerance * scale, (error, scale, error / scale)


def dot_flops(jaxpr) -> int:
  """2 x output elements x contracted size, summed over every dot_general of a jaxpr, nested
  ones too: the matmul FLOPs an analytic count is held to."""
  from jax.extend import core as jax_core  # pylint: disable=g-import-not-at-top
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      (contracting, _), _ = eqn.params['dimension_numbers']
      lhs_shape = eqn.invars[0].aval.shape
      total += 2 * int(np.prod(eqn.outvars[0].aval.shape)) * int(
          np.prod([lhs_shape[i] for i in contracting]))
    for sub in jax_core.jaxprs_in_params(eqn.params):
      total += dot_flops(sub)
  return total


@functools.cache
def encoder_only_params(config):
  """Fresh parameters of an encoder-only model config (a TransformerConfig), drawn with the
  'rbg' generator (quick to compile)."""
  from t2t_jax.model import encoder_only  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  dummy = jnp.ones((1, 4), jnp.int32)
  return nn.meta.unbox(encoder_only.EncoderOnly(config).init(
      jax.random.key(0, impl='rbg'), dummy, dummy)['params'])


def leaves_equal(a, b) -> bool:
  """Whether two trees hold bitwise equal arrays, leaf by leaf."""
  return all(np.array_equal(np.asarray(x), np.asarray(y))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def saved_state_field(step_dir, name: str = 'params'):
  """One field of a training checkpoint's `state` item (params, ema, opt_state), read with
  plain orbax as numpy: a reader independent of t2t_jax's."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  item = os.path.join(step_dir, 'state')
  checkpointer = ocp.PyTreeCheckpointer()
  saved = checkpointer.metadata(item).item_metadata.tree[name]
  args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
  return checkpointer.restore(item, args=ocp.args.PyTreeRestore(
      item={name: saved}, restore_args={name: args}, partial_restore=True))[name]


def write_lines(path, lines):
  """Writes text lines (str) or raw lines (bytes), each followed by a newline."""
  with open(path, 'wb') as f:
    for line in lines:
      f.write((line.encode('utf-8') if isinstance(line, str) else line) + b'\n')
  return str(path)


def text_config(tiny_config, tmp_path, count=200):
  """Points `tiny_config` at small generated parallel files in `tmp_path`."""
  rng = np.random.default_rng(0)
  words = ['haus', 'katze', 'hund', 'baum', 'auto', 'blume', 'stadt', 'fluss']
  english = ['house', 'cat', 'dog', 'tree', 'car', 'flower', 'city', 'river']
  picks = [rng.integers(0, 8, rng.integers(2, 7)) for _ in range(count)]
  src = [' '.join(english[i] for i in p) for p in picks]
  tgt = [' '.join(words[i] for i in p) for p in picks]
  cfg = tiny_config
  cfg.data.source = 'text'
  cfg.data.train_src = write_lines(tmp_path / 'train.src', src)
  cfg.data.train_tgt = write_lines(tmp_path / 'train.tgt', tgt)
  cfg.data.eval_src = write_lines(tmp_path / 'eval.src', src[:20])
  cfg.data.eval_tgt = write_lines(tmp_path / 'eval.tgt', tgt[:20])
  cfg.data.vocab_size = 40
  return cfg


def scalar_events(workdir) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} from a workdir's event files ({} when it has none)."""
  from t2t_jax import plot  # pylint: disable=g-import-not-at-top
  try:
    scalars = plot.read_scalars(str(workdir))
  except FileNotFoundError:
    return {}
  return {tag: dict(zip(series.steps, series.values)) for tag, series in scalars.items()}


def assert_cached_decoding_matches_teacher_forcing(config, params, inputs, targets):
  """Decoding one target token at a time through the cache gives the teacher-forced logits."""
  from t2t_jax.decoding import decode  # pylint: disable=g-import-not-at-top
  from t2t_jax.model import transformer as model_lib  # pylint: disable=g-import-not-at-top
  # Each apply jitted: one compilation of each (the step twice: its first call adds the
  # cross-attention entries to the cache), where eager applies compile every operation apart.
  full = quick_jit(model_lib.Transformer(config).apply)({'params': params}, inputs, targets)
  step_model = model_lib.Transformer(decode.decode_config(config))
  encoded = quick_jit(step_model.apply, static_argnames='method')(
      {'params': params}, inputs, method=model_lib.Transformer.encode)
  step = quick_jit(lambda params, cache, encoded, inputs, previous: step_model.apply(
      {'params': params, 'cache': cache}, encoded, inputs, previous, mutable=['cache'],
      method=model_lib.Transformer.decode))
  length = targets.shape[1]
  cache = decode.init_cache(config, targets.shape[0], length)
  previous = model_lib.shift_right(targets)
  for t in range(length):
    logits, variables = step(params, cache, encoded, inputs, previous[:, t:t + 1])
    cache = variables['cache']
    # GPUs multiply float32 matrices in TF32 by default (10-bit mantissa): 1e-3 relative.
    np.testing.assert_allclose(logits[:, 0], full[:, t],
                               atol=2e-3 if jax.devices()[0].platform == 'gpu' else 1e-5)


# Two runs that take the same Adam steps on gradients differing only in float32 rounding (another
# reduction order: the batch split over devices, hosts or micro-batches) cannot be compared with
# one rtol on the parameters. Adam moves a weight by lr_t * m_t / (sqrt(v_t) + eps) (bias-corrected
# moments), a ratio that does not scale with the gradient, so the rounding error e of a gradient
# g enters as e / sqrt(v_t), not as e / |p|:
#   - where sqrt(v_t) is well above the noise, d(m / sqrt(v)) is at most about 2 |e| / sqrt(v_t)
#     (|e| / sqrt(v_t) through m, the same again through v since |m / sqrt(v)| is about 1 or less
#     over a few steps, exactly 1 at the first);
#   - where sqrt(v_t) is of the order of the noise, the gradient is rounding noise, its sign may
#     differ between the runs, and each run moves the weight by up to about lr_t either way: the
#     two differ by at most 2 lr_t (2.5 lr_t with a margin for |m / sqrt(v)| above 1).
# So after the steps t = 1..T, per weight,
#   |p - p_reference| <= sum_t lr_t * min(2.5, 2 eta_t / sqrt(v_t)) + float32 rounding of p,
# with eta_t = GRADIENT_NOISE * max |g_t| over the tensor and v_t the reference run's moment
# after step t. GRADIENT_NOISE: summing n float32 terms in another order errs by about
# sqrt(n) * 2^-24 relative to the largest (2e-6 for the tiny runs' thousands of tokens); 1e-5
# leaves a margin of 5, which also covers the later gradients' change from the weights that
# already differ (those are the weights the loss is flat along, the ones with noise gradients).
# The first step starts from the same weights, so its gradients (m_1 = (1 - b1) g_1) must agree
# to the noise alone.
GRADIENT_NOISE = 1e-5


def adam_moments(opt_state):
  """(mu, nu) of the one Adam stage in an optax state (a chain, clipped or not), or in one as a
  checkpoint saves it (its stages as dicts: saved_state_field)."""
  import optax  # pylint: disable=g-import-not-at-top
  saved = lambda x: isinstance(x, dict) and {'mu', 'nu'} <= set(x)
  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState) or saved(x)
  stages = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
  assert len(stages) == 1, stages
  return (stages[0]['mu'], stages[0]['nu']) if saved(stages[0]) else (stages[0].mu,
                                                                       stages[0].nu)


def assert_adam_runs_agree(run, reference, rates, b1=0.9, b2=0.98):
  """`run` and `reference`: [(params, opt_state)] after each of the same T Adam steps (on host);
  `rates`: the learning rate of each step. Asserts the bound derived above; returns it, per
  weight (a list of arrays in the order of jax.tree.leaves(params))."""
  assert len(reference) == len(rates) >= 1 and 1 <= len(run) <= len(reference)  # Run: or
  # only its first and last steps, which are all the bound reads of it.
  leaves = lambda tree: jax.tree.leaves(jax.device_get(tree))
  first_mu, reference_first_mu = (leaves(adam_moments(r[1])[0]) for r in (run[0], reference[0]))
  for mu, expected in zip(first_mu, reference_first_mu):
    np.testing.assert_allclose(mu, expected, rtol=1e-4,
                               atol=GRADIENT_NOISE * (1 - b1) * np.abs(expected).max())
  bound = [np.zeros(np.shape(p)) for p in leaves(reference[-1][0])]
  for t, ((_, opt_state), rate) in enumerate(zip(reference, rates), start=1):
    for i, nu in enumerate(leaves(adam_moments(opt_state)[1])):
      root_v = np.sqrt(np.asarray(nu, np.float64) / (1 - b2**t))  # About |g| of recent steps.
      eta = GRADIENT_NOISE * root_v.max()
      with np.errstate(divide='ignore'):
        bound[i] += rate * np.minimum(2.5, np.where(root_v > 0, 2 * eta / root_v, np.inf))
  moving = [np.asarray(nu) > 0 for nu in leaves(adam_moments(reference[-1][1])[1])]
  tight = 0
  for actual, expected, limit, moved in zip(leaves(run[-1][0]), leaves(reference[-1][0]), bound,
                                            moving):
    limit = limit + 1e-6 * np.abs(expected)
    excess = np.abs(np.asarray(actual, np.float64) - expected) - limit
    assert np.all(excess <= 0), (
        f'{np.sum(excess > 0)} of {excess.size} weights beyond the bound, by up to '
        f'{excess.max():.3g} (bound there {limit.flat[excess.argmax()]:.3g})')
    tight += np.sum(moved & (limit < 0.1 * sum(rates)))
  # The bound is not vacuous: a wrong gradient moves a weight by about lr a step, and most
  # weights with a gradient are held to a tenth of that.
  assert tight > 0.9 * sum(np.sum(m) for m in moving), (tight, sum(np.sum(m) for m in moving))
  return bound


def assert_moved_run_agrees(workdir, reference_workdir, steps: int, config) -> None:
  """A run that moved between shapes (devices, mesh splits, processes: other reduction orders
  of the same sums) against a reference that stayed on one, both saving every step 1..`steps`
  with `config`'s schedule: the parameters at `steps` within assert_adam_runs_agree's bound,
  and the moving average (if kept), a convex mix of the parameters of steps 0..`steps`, within
  the bound at `steps` (the bound only grows with the steps)."""
  from t2t_jax.training import optim  # pylint: disable=g-import-not-at-top
  state = lambda directory, step: tuple(
      saved_state_field(f'{directory}/checkpoints/{step}', field) for field in
      ('params', 'opt_state'))
  schedule = optim.learning_rate_schedule(config.opt, config.model.d_model,
                                          config.train.num_steps)
  reference = [state(reference_workdir, step) for step in range(1, steps + 1)]
  bound = assert_adam_runs_agree(
      [state(workdir, 1), state(workdir, steps)], reference,
      [float(schedule(step - 1)) for step in range(1, steps + 1)], config.opt.b1, config.opt.b2)
  if config.opt.ema_decay:
    ema, expected = (jax.tree.leaves(saved_state_field(f'{d}/checkpoints/{steps}', 'ema'))
                     for d in (workdir, reference_workdir))
    for actual, wanted, limit in zip(ema, expected, bound, strict=True):
      excess = (np.abs(np.asarray(actual, np.float64) - wanted) - limit
                - 1e-6 * np.abs(wanted))
      assert np.all(excess <= 0), f'moving average beyond the bound by up to {excess.max():.3g}'


# The tiny copy task's sequences are 1..8 symbols then EOS. A model blind to the source can at
# best guess the first symbol (1 in 8) and then say EOS, the likeliest next token at every later
# position (P(EOS | t symbols so far) = 1 / (9 - t) beats each symbol's (8 - t) / (8 (9 - t))):
# (1/8 + 1) / 5.5 tokens = 0.205 accuracy on average; 0.3 is 4 standard deviations above that on
# the 64 evaluation examples. Only a model that reads the source through its attention gets
# there (60 steps at 3e-3 reach 0.38 to 0.40 for the family members tested).
BLIND_COPY_ACCURACY = 0.205
LEARNED_COPY_ACCURACY = 0.3


def learns_to_copy(config, steps=60):
  """`config` set to train the tiny copy task for `steps` at a constant rate, no dropout."""
  config.opt.schedule, config.opt.lr_scale = 'constant', 3e-3
  config.model.dropout = 0.0
  config.train.num_steps = config.train.eval_every = steps
  config.ckpt.every = 0
  return config


def _compiler_or_skip(module: str, what: str, extra: str, required_in_ci: bool):
  """Skips a test whose compiler package is missing, with the reason; in CI, where .ci/run
  installs the test extra, a missing package is a failure, not a skip."""
  if importlib.util.find_spec(module) is None:
    reason = f'{what} is not installed here: pip install -e \'.[{extra}]\''
    if required_in_ci and os.environ.get('CI'):
      pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture
def no_persistent_cache():
  """For tests that compile for a target themselves: JAX cannot read a compile-only target's
  program back from the persistent cache (the dry run turns it off the same way)."""
  from t2t_jax.compile import dry_run  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  with dry_run.persistent_cache(False):
    yield


@pytest.fixture
def libtpu():
  """libtpu, the TPU compiler, which compiles for TPU targets on this CPU."""
  _compiler_or_skip('libtpu', 'libtpu (the TPU compiler)', 'test', required_in_ci=True)


@pytest.fixture
def cuda_compiler():
  """JAX's CUDA plugin, whose XLA compiles for GPU targets on this CPU."""
  _compiler_or_skip('jax_cuda12_plugin', "JAX's CUDA 12 plugin", 'gpu-compile',
                    required_in_ci=False)


@pytest.fixture
def cudnn_compiler(cuda_compiler):
  """cuDNN beside JAX's CUDA plugin: JAX reads its version to lower cuDNN attention."""
  del cuda_compiler
  _compiler_or_skip('nvidia.cudnn', 'cuDNN (nvidia-cudnn-cu12)', 'gpu-compile',
                    required_in_ci=False)


def assert_drawn(path) -> None:
  """`path` is a PNG with something drawn on it: read back as pixels (not by its size in
  bytes, which moves with the matplotlib and zlib builds), at least 200 x 200, with at least
  1% of its pixels off the background (the colour of its corner)."""
  from matplotlib import image  # pylint: disable=g-import-not-at-top
  with open(path, 'rb') as f:
    assert f.read(8) == b'\x89PNG\r\n\x1a\n', path
  pixels = image.imread(str(path))
  assert pixels.ndim == 3 and min(pixels.shape[:2]) >= 200, (path, pixels.shape)
  drawn = np.any(np.abs(pixels - pixels[0, 0]) > 0.05, axis=-1)
  assert drawn.mean() > 0.01, (path, drawn.mean())
