"""t2t_jax: the Transformer of "Attention Is All You Need", trained the tensor2tensor way on JAX."""

PAD_ID = 0
EOS_ID = 1
