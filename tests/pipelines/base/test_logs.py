"""-v / -q through the CLI: what reaches stderr at each verbosity, while results stay on stdout."""

import pytest

from pipelines.base import logs
from pipelines.data.ingest import BUNDLED
from ssp import cli
from tests.test_hostile_input import write_tables


@pytest.fixture(autouse=True)
def default_verbosity():
    yield
    logs.configure(0)  # the CLI sets the process-wide level: put the default back for the next test


def counts(tmp_path, *flags):
    paths = write_tables(
        tmp_path / "in",
        [(1, 10, 4.0), (2, 10, 3.0), (3, 30, 2.5)],
        {1: [0.6, 0.8], 2: [0.5, -0.5], 3: [0.0, 1.0]},
        [10, 20, 30],
    )
    return cli.main(
        [
            "counts",
            "--interactions",
            paths["interactions"],
            "--items",
            paths["items"],
            "--out",
            str(tmp_path / "run"),
            "--epsilon",
            "1",
            *flags,
        ]
    )


def test_default_shows_progress_quiet_hides_it_verbose_adds_the_releases(spark, tmp_path, capsys):
    """On the default engine, Spark: the test session's (`spark`), which the command uses as it finds it."""
    assert counts(tmp_path / "a") == 0
    out, err = capsys.readouterr()
    assert "counts: release 0, noise multiplier" in err and "released DP counts of 3 items" in out
    assert "epsilon spent" not in err  # a detail

    assert counts(tmp_path / "b", "-q") == 0
    out, err = capsys.readouterr()
    assert err == "" and "released DP counts of 3 items" in out  # the result stays

    assert counts(tmp_path / "c", "--verbose") == 0
    err = capsys.readouterr().err
    assert "counts: release 0" in err and "release 0 counts: {" in err and "epsilon spent" in err and "of 1" in err


def test_quiet_turns_the_progress_bars_off(tmp_path, capsys):
    assert cli.main(["ingest", "--source", BUNDLED, "--out", str(tmp_path / "loud")]) == 0
    assert "ratings" in capsys.readouterr().err  # tqdm's bar
    assert cli.main(["ingest", "--source", BUNDLED, "--out", str(tmp_path / "quiet"), "-q"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and "wrote" in out


def test_verbose_and_quiet_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        cli.main(["counts", "-v", "-q", "--interactions", "x", "--items", "y", "--out", "z"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_importing_beam_prints_nothing_about_bigquery():
    """Beam's import-time note on its optional BigQuery client (which the project never uses) stays off stderr."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", "import pipelines.base.logs, apache_beam"], capture_output=True, text=True, check=True
    )
    assert "apitools" not in done.stderr
    bare = subprocess.run([sys.executable, "-c", "import apache_beam"], capture_output=True, text=True, check=True)
    assert "apitools not found" in bare.stderr  # what the filter is for: Beam still says it without it


def test_verbose_shows_py4j_teardown_but_not_its_protocol():
    """-v shows py4j's connection teardown (info) but not every command it sends to the JVM (debug:
    thousands of lines a Spark run); the default hides both."""
    import logging

    py4j = logging.getLogger("py4j.clientserver")
    logs.configure(1)
    assert py4j.isEnabledFor(logging.INFO) and not py4j.isEnabledFor(logging.DEBUG)
    logs.configure(0)
    assert not py4j.isEnabledFor(logging.ERROR)
