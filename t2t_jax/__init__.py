"""t2t_jax: the Transformer of "Attention Is All You Need", trained the tensor2tensor way on JAX."""

PAD_ID = 0
EOS_ID = 1


class ConfigError(ValueError):
  """A config value (or a flag standing for one) that cannot work, named with what to do."""


class NonFiniteLoss(FloatingPointError):
  """Training stopped at a NaN or infinite loss; the message names the step and what to do."""
