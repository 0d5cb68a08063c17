"""Three seeds of one run (parameter init, dropout, masks, batch order): the rows of
docs/pretraining.md's table, each run from scratch and from the pre-trained encoder.

  python launch/sweep.py configs/sweeps/bert_seeds.py -- \
      python -m t2t_jax.main --config=configs/bert.py:small,finetune --workdir=/tmp/bert/sst2_pre \
      --config.ckpt.init_from=/tmp/bert/pre/checkpoints/3500 \
      --config.data.vocab_path=/tmp/bert/pre/vocab.model
  python bench/finetune_table.py /tmp/bert
"""


def get_sweep():
  return {'product': {'seed': [0, 1, 2]}}
