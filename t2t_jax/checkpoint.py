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
