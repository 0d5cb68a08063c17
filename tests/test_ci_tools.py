"""The CI helpers in .ci/: where the suite's time goes, read from a JUnit report."""

from conftest import load_script


def _durations():
  return load_script('.ci/durations.py')


REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_one" time="1.5"/>
<testcase classname="tests.test_a" name="test_two[x]" time="2.5"/>
<testcase classname="tests.test_b" name="test_three" time="6.0"><skipped/></testcase>
<testcase classname="tests.sub.test_c" name="test_four" time="0"/>
</testsuite></testsuites>
"""


def test_durations_sums_each_file_and_names_its_slowest_test(tmp_path, capsys):
  report = tmp_path / 'suite.xml'
  report.write_text(REPORT)
  assert _durations().main([str(report)]) == 0
  lines = capsys.readouterr().out.splitlines()
  # 10 s in all: test_b 6 (60%), test_a 1.5 + 2.5 = 4 (40%), test_c 0; heaviest first.
  assert lines == [
      '     6.0 s  60.0%  tests/test_b.py  (slowest: test_three, 6.0 s)',
      '     4.0 s  40.0%  tests/test_a.py  (slowest: test_two[x], 2.5 s)',
      '     0.0 s   0.0%  tests/sub/test_c.py  (slowest: test_four, 0.0 s)',
      '    10.0 s summed over 3 files']
  assert _durations().main([str(report), '--top=1']) == 0
  assert capsys.readouterr().out.splitlines()[1:] == ['    10.0 s summed over 3 files']


def test_durations_says_error_for_a_report_it_cannot_read(tmp_path, capsys):
  broken = tmp_path / 'broken.xml'
  broken.write_text('<testsuites><testcase')
  for path in (broken, tmp_path / 'missing.xml'):
    assert _durations().main([str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ''
    assert captured.err.startswith(f'error: {path}: not a readable JUnit XML report (')
    assert len(captured.err.splitlines()) == 1
