"""tools/bench.py, the benchmarks' one entry: its help names every row, each row is a script beside
it, a row runs with its own flags and exit status, and a bad row or flag is one error line."""

import subprocess
import sys

from dist_harness import REPO

BENCH = REPO / "tools" / "bench.py"


def bench(*args):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_the_help_names_every_row_and_each_row_is_a_script():
    sys.path.insert(0, str(REPO / "tools"))
    from bench import ROWS

    shown = bench("--help")
    assert shown.returncode == 0
    for row, script in ROWS.items():
        assert f"\n    {row} " in shown.stdout, row
        assert (REPO / "tools" / script).is_file(), script


def test_a_bad_row_is_one_error_line():
    ran = bench("no-such-row")
    assert ran.returncode == 2
    assert ran.stderr.strip().count("\n") == 0 and ran.stderr.startswith("error: no benchmark row 'no-such-row'")


def test_a_row_takes_its_own_flags_and_keeps_its_exit_status():
    shown = bench("step-phases", "--help")
    assert shown.returncode == 0 and "--kl-probe-sequences" in shown.stdout
    assert "usage: benchmark_step_phases" in shown.stdout
    refused = bench("step-phases", "--preset", "no-such-preset")
    assert refused.returncode != 0
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown model preset 'no-such-preset'"), refused.stderr
