"""Where the suite's time goes: each test file's summed time (setup, call and teardown) from a
JUnit XML report, heaviest first, with its share of the whole and its slowest test.

    python -m pytest -q -n 2 --junitxml=/tmp/suite.xml tests
    python .ci/durations.py /tmp/suite.xml [--top=15]   # one line a file, then the total

With two workers the wall time is about half the summed time: a file's share of the sum is
its share of the wall.
"""

import argparse
import collections
import sys
import xml.etree.ElementTree as ElementTree


def per_file(path: str) -> tuple[dict, dict]:
  """{file: summed seconds} and {file: (seconds, name) of its slowest test} of one report."""
  totals, slowest = collections.Counter(), {}
  for case in ElementTree.parse(path).getroot().iter('testcase'):
    name = case.get('classname', '').replace('.', '/') + '.py'
    seconds = float(case.get('time') or 0)
    totals[name] += seconds
    slowest[name] = max(slowest.get(name, (0.0, '')), (seconds, case.get('name', '')))
  return totals, slowest


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('report')
  parser.add_argument('--top', type=int, default=15)
  args = parser.parse_args(argv)
  try:
    totals, slowest = per_file(args.report)
  except (OSError, ElementTree.ParseError) as e:
    print(f'error: {args.report}: not a readable JUnit XML report ({e})', file=sys.stderr)
    return 1
  whole = sum(totals.values())
  for name, seconds in totals.most_common(args.top):
    worst, test = slowest[name]
    print(f'{seconds:8.1f} s {100 * seconds / whole:5.1f}%  {name}  (slowest: {test}, '
          f'{worst:.1f} s)')
  print(f'{whole:8.1f} s summed over {len(totals)} files')
  return 0


if __name__ == '__main__':
  sys.exit(main())
