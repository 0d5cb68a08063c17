"""The command-line tools' shared behaviour: strict JSON lines, one-line errors, short usage."""

import json
import math

from t2t_jax import cli


def test_json_line_writes_null_with_the_reason_for_nan_and_infinity():
  line = cli.json_line({'step': 3, 'train_loss': math.nan, 'eval': {'loss': -math.inf},
                        'rates': [1.0, math.inf], 'mfu': None,
                        'null_reasons': {'mfu': 'unknown peak'}},
                       reasons={'train_loss': 'no training step ran'})
  assert 'NaN' not in line and 'Infinity' not in line and '\n' not in line
  record = json.loads(line)  # Python's parser accepts NaN; a strict one must accept it too.
  assert record['train_loss'] is None and record['eval'] == {'loss': None}
  assert record['rates'] == [1.0, None] and record['step'] == 3
  assert record['null_reasons'] == {'mfu': 'unknown peak', 'train_loss': 'no training step ran',
                                    'eval.loss': 'was -inf', 'rates[1]': 'was inf'}
  assert 'null_reasons' not in json.loads(cli.json_line({'loss': 1.5}))
