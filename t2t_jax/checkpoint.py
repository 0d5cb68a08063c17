"""Orbax checkpoints of the train state, the data iterator position and the config."""

import os

from absl import logging
import orbax.checkpoint as ocp


class Checkpointer:
  """Saves every `every` steps (and on demand), keeps the last `keep`, restores the latest."""

  def __init__(self, workdir: str, ckpt_config):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self.every = ckpt_config.every
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=ckpt_config.keep, create=True,
                                             enable_async_checkpointing=True))

  def should_save(self, step: int) -> bool:
    return self.every > 0 and step % self.every == 0

  def save(self, step: int, state, data_state: dict, config_json: str) -> None:
    """Starts an asynchronous save; returns once the arrays are copied off the device."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        config=ocp.args.JsonSave({'config': config_json})), force=True)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore(self, abstract_state) -> tuple[object, dict] | None:
    """(state, data iterator state) of the latest checkpoint, or None if there is none."""
    step = self.manager.latest_step()
    if step is None:
      return None
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    logging.info('Restored checkpoint %d from %s', step, self.directory)
    return restored['state'], restored['data']

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def restore_params(workdir: str, abstract_params, checkpoint: str | None = None):
  """Parameters only, from the latest step (None), a step ('12000'), or a checkpoint directory.

  `abstract_params` gives the tree, shapes, dtypes and shardings to restore into; the
  optimiser state is never read.
  """
  directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
  if checkpoint is None or checkpoint.isdigit():
    steps = sorted(int(name) for name in (os.listdir(directory) if os.path.isdir(directory)
                                          else []) if name.isdigit())
    if not steps:
      raise FileNotFoundError(f'no checkpoint in {directory}: train in {workdir} first, or '
                              'pass --checkpoint=PATH to a checkpoint directory')
    step = steps[-1] if checkpoint is None else int(checkpoint)
    if step not in steps:
      raise FileNotFoundError(f'no checkpoint of step {step} in {directory}; it holds steps '
                              f'{steps}')
    path = os.path.join(directory, str(step), 'state')
  else:
    path = os.path.abspath(checkpoint)
    if os.path.isdir(os.path.join(path, 'state')):
      path = os.path.join(path, 'state')
  if not os.path.isdir(path):
    raise FileNotFoundError(f'checkpoint {path} does not exist')
  item = {'params': abstract_params}
  restored = ocp.PyTreeCheckpointer().restore(path, args=ocp.args.PyTreeRestore(
      item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
      partial_restore=True))
  logging.info('Restored parameters from %s', path)
  return restored['params']
