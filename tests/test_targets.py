"""targets: names of TPU slices and GPU hosts, their compile-only devices, their figures."""

import pytest

from t2t_jax import ConfigError
from t2t_jax.compile import targets
from t2t_jax.model import flops


@pytest.mark.parametrize('name, chip, per_slice, slices, platform', [
    ('tpu:v5e-8', 'v5e', 8, 1, 'tpu'),
    ('tpu:v5e-16', 'v5e', 16, 1, 'tpu'),
    ('tpu:v4-8', 'v4', 4, 1, 'tpu'),  # v4 and v5p sizes count TensorCores, two per chip.
    ('tpu:v5p-8', 'v5p', 4, 1, 'tpu'),
    ('tpu:v6e-8', 'v6e', 8, 1, 'tpu'),
    ('tpu:2xv5e-16', 'v5e', 16, 2, 'tpu'),
    ('gpu:h100x8', 'h100', 8, 1, 'gpu'),
    ('gpu:4xh100x8', 'h100', 8, 4, 'gpu'),
    ('gpu:a100x8', 'a100', 8, 1, 'gpu'),
    ('gpu:h200x1', 'h200', 1, 1, 'gpu'),
    ('gpu:b200x8', 'b200', 8, 1, 'gpu'),
])
def test_target_names(name, chip, per_slice, slices, platform):
  target = targets.parse(name)
  assert (target.chip_name, target.per_slice, target.slices, target.platform) == (
      chip, per_slice, slices, platform)
  assert target.num_devices == per_slice * slices


@pytest.mark.parametrize('name, message', [
    ('tpu:v9-8', 'is not a target t2t_jax knows'),
    ('gpu:v5e8', 'is not a target t2t_jax knows'),
    ('tpu:h100-8', 'is not a target t2t_jax knows'),
    ('v5e-8', 'is not a target t2t_jax knows'),
    ('tpu:v5e-6', 'power of two chips'),
    ('tpu:v4-6', 'power of two chips'),
    ('tpu:v4-3', 'counts its TensorCores'),
    ('gpu:h100x16', 'a host has at most 8'),
    ('tpu:v5e-512', 'at most 256 chips'),
])
def test_unknown_or_impossible_targets_are_refused_naming_the_flag(name, message):
  with pytest.raises(ConfigError, match=message) as error:
    targets.parse(name)
  assert f'--dry_run_target={name!r}' in str(error.value)


@pytest.mark.parametrize('chip, chips, grid', [
    ('v5e', 1, (1, 1)), ('v5e', 8, (2, 4)), ('v5e', 16, (4, 4)), ('v5e', 256, (16, 16)),
    ('v4', 4, (2, 2, 1)), ('v4', 8, (2, 2, 2)), ('v5p', 64, (4, 4, 4)), ('v4', 1, (1, 1, 1)),
    # Cloud's v5p table: 2x4x4 holds 32 chips, 4x4x8 128, 4x8x8 256.
    ('v5p', 32, (2, 4, 4)), ('v4', 128, (4, 4, 8)), ('v5p', 256, (4, 8, 8)),
])
def test_slice_grids(chip, chips, grid):
  assert targets._tpu_grid('x', targets.CHIPS[chip], chips, chips) == grid


def test_every_chip_has_a_published_peak_and_sane_figures():
  for name, chip in targets.CHIPS.items():
    assert set(flops.PEAK_FLOPS[chip.family]) >= {'bfloat16', 'float32'}, name
    # Machine balance (FLOPs per byte of HBM) of today's accelerators: tens to hundreds.
    balance = flops.PEAK_FLOPS[chip.family]['bfloat16'] / chip.memory_bandwidth
    assert 50 < balance < 600, (name, balance)
    assert chip.network_bandwidth < chip.interconnect_bandwidth < chip.memory_bandwidth
  # The device kinds JAX reports for them map back to the same peaks.
  for kind, family in (('TPU v5 lite', 'tpu_v5e'), ('TPU v6 lite', 'tpu_v6e'),
                       ('TPU v4', 'tpu_v4'), ('TPU v5', 'tpu_v5p'), ('NVIDIA B200', 'b200'),
                       ('NVIDIA H100 80GB HBM3', 'h100_sxm'), ('NVIDIA H200', 'h200'),
                       ('NVIDIA A100-SXM4-80GB', 'a100')):
    assert flops.device_family(kind) == family


def test_gpu_target_config_carries_the_chip_figures():
  text = targets.gpu_target_config(targets.CHIPS['h100'])
  assert 'core_count: 132' in text and 'cuda_compute_capability { major: 9 minor: 0 }' in text
  assert f'device_memory_size: {targets.CHIPS["h100"].memory_bytes}' in text
  assert 'device_description_str: "NVIDIA H100 80GB HBM3"' in text
  assert text.count('{') == text.count('}')


def test_tpu_devices_without_a_tpu(libtpu):
  del libtpu
  for name, count, kind in (('tpu:v5e-8', 8, 'TPU v5 lite'), ('tpu:v4-8', 4, 'TPU v4'),
                            ('tpu:v6e-8', 8, 'TPU v6 lite'), ('tpu:2xv5e-8', 16, 'TPU v5 lite')):
    target = targets.parse(name)
    devices = targets.devices(target)
    assert len(devices) == count and {d.device_kind for d in devices} == {kind}
    assert {d.platform for d in devices} == {'tpu'}
    granules = targets.granule_of(target, devices)
    assert sorted(set(granules.values())) == list(range(target.slices))


def test_gpu_devices_without_a_gpu(cuda_compiler):
  del cuda_compiler
  target = targets.parse('gpu:2xh200x8')
  devices = targets.devices(target)
  assert len(devices) == 16 and {d.device_kind for d in devices} == {'NVIDIA H200'}
  assert sorted(set(targets.granule_of(target, devices).values())) == [0, 1]


def test_the_target_of_a_real_device_by_its_kind():
  kind = lambda name: type('Device', (), {'device_kind': name})()
  h100 = targets.of_device(kind('NVIDIA H100 80GB HBM3'))
  assert (h100.name, h100.chip_name, h100.num_devices) == ('gpu:h100x1', 'h100', 1)
  assert targets.of_device(kind('TPU v4')).name == 'tpu:v4-2'
  assert targets.parse(targets.of_device(kind('TPU v5 lite')).name).chip_name == 'v5e'
  assert targets.of_device(kind('cpu')) is None
  assert targets.of_device(kind('NVIDIA H100 NVL')) is None  # Not the SXM's figures.


@pytest.mark.parametrize('name, error, extra', [
    ('gpu:a100x8', NotImplementedError('topology not implemented for cuda'), 'gpu-compile'),
    ('tpu:v6e-4', RuntimeError('JAX TPU support not installed; cannot generate TPU topology.'),
     'tpu'),
])
def test_a_missing_compiler_is_one_line_naming_the_extra(monkeypatch, name, error, extra):
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

  def missing(**unused):
    raise error
  monkeypatch.setattr(topologies, 'get_topology_desc', missing)
  with pytest.raises(ConfigError, match=rf"pip install -e '\.\[{extra}\]'") as raised:
    targets.devices(targets.parse(name))
  assert 'is not installed here' in str(raised.value)
