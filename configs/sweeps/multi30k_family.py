"""The model family compared on Multi30k: every member at one budget and schedule.

  python launch/sweep.py configs/sweeps/multi30k_family.py -- \
    python -m t2t_jax.main --config=configs/multi30k.py:speedrun --workdir=/tmp/m30_family \
    --config.train.num_steps=2300 --config.opt.cooldown_steps=767 --config.train.eval_every=2300 \
    --config.ckpt.keep=10
  # then, in each point's directory D: the last 10 checkpoints averaged, beam 5
  python -m t2t_jax.average --workdir=D --last=10
  python -m t2t_jax.evaluate --workdir=D --checkpoint=D/averaged/avg10_1400-2300 --beam_size=5

The speedrun's schedule (twice the paper's peak rate after 500 warmup updates, a linear
cooldown over the last third, dropout 0.2) ended at 2,300 updates. Every member changes one
thing from the pre-LN model with sinusoids (the speedrun's until this sweep chose rotary
positions for it; DEFAULTS sets sinusoids), except the paper's row: the paper's own post-LN
model. The paper's row and the pre-LN sinusoid row are run with three seeds each, to measure
the run-to-run noise the other rows are read against.
"""

# What each member changes; every other key keeps the value of DEFAULTS (the base command's).
DEFAULTS = {'seed': 0, 'model.norm': 'pre', 'model.positions': 'sinusoidal',
            'model.attention_pattern': 'full', 'model.local_half_width': 256,
            'model.moe_experts': 0, 'model.kind': 'encoder_decoder',
            'model.num_decoder_layers': 4, 'model.prefix_attention': 'causal',
            'data.max_len': 64, 'data.pack_length': 0}
DECODER_ONLY = {'model.kind': 'decoder_only', 'model.num_decoder_layers': 10,
                'data.max_len': 128, 'data.pack_length': 64}  # As configs/multi30k.py's.
MEMBERS = [  # Run in this order.
    {'model.norm': 'post'},  # The paper's model; seeds 1 and 2 below.
    {},  # Pre-LN, sinusoids: the speedrun's model before this sweep.
    {'model.positions': 'learned'},
    {'model.positions': 'rotary'},
    {'model.positions': 'alibi'},
    {'model.positions': 'relative'},
    {'model.positions': 'predictive'},
    {'model.attention_pattern': 'local,compressed', 'model.local_half_width': 8},
    {'model.moe_experts': 4},  # Top-2 (the default) in every other layer.
    {'seed': 1},  # Pre-LN, sinusoids again: its seed-to-seed noise.
    {'seed': 2},
    {**DECODER_ONLY, 'model.prefix_attention': 'full'},  # A prefix LM.
    {**DECODER_ONLY},  # Causal throughout.
    {'model.norm': 'post', 'seed': 1},
    {'model.norm': 'post', 'seed': 2},
]


def get_sweep():
  points = [{**DEFAULTS, **member} for member in MEMBERS]
  return {'zip': {key: [point[key] for point in points] for key in DEFAULTS}}
