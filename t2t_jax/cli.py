"""What every command-line tool shares: one-line errors, a short usage line, strict JSON lines."""

import json
import math
from typing import Any


def json_line(record: dict[str, Any], reasons: dict[str, str] | None = None) -> str:
  """`record` as one line of strict JSON: NaN and infinities become null, the reason beside them.

  Reasons go under "null_reasons" ({key: why}); a non-finite value without one is explained
  by its value ("was nan"). Python's json would write NaN, which JSON parsers refuse.
  """
  reasons = dict(record.get('null_reasons') or {}, **(reasons or {}))

  def finite(value, key):
    if isinstance(value, float) and not math.isfinite(value):
      reasons.setdefault(key, f'was {value}')
      return None
    if isinstance(value, dict):
      return {k: finite(v, f'{key}.{k}' if key else k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
      return [finite(v, f'{key}[{i}]') for i, v in enumerate(value)]
    return value

  cleaned = finite({k: v for k, v in record.items() if k != 'null_reasons'}, '')
  if reasons:
    cleaned['null_reasons'] = reasons
  return json.dumps(cleaned, allow_nan=False)
