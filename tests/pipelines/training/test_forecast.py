"""`ssp train --plan --forecast-users N`: the same settings run on a synthetic log of the declared
shape at half, the requested and twice the epsilon, spending nothing of the operator's (no ledger,
no budget account, nothing left behind); a warning when the requested epsilon lands at or below the
baseline; misplaced forecast flags refused in one line by the installed command."""

import os
import re
import subprocess
import sys
import tempfile

import pytest

from pipelines.training import forecast
from ssp import cli


def test_a_forecast_runs_the_pipeline_on_a_synthetic_log_and_spends_nothing(
    tmp_path, monkeypatch, capsys, budget_account_registry
):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the forecast's folder goes, to see it removed
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--plan", "--epsilon", "4", "--forecast-users", "300", "--forecast-history", "20"]
    own = tmp_path.parent / f"{tmp_path.name}-own"  # the operator's: a --config file naming data and out, a seed
    own.mkdir()
    (own / "run.toml").write_text(f'data = "{own / "data"}"\nout = "{own / "run"}"\n')
    argv += ["--config", str(own / "run.toml"), "--seed-file", str(own / "seed")]
    assert cli.main([*argv, "--forecast-like", "movielens"]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"^\| (\S+) \| (\d+) \((\d+)%\) \| (\S+) \| (\S+) \| (\S+) \|$", out, re.MULTILINE)
    assert [row[0] for row in rows] == ["2", "4", "8"]  # half, the requested and twice the epsilon
    for _, _, _, model, baseline, gap in rows:
        assert 0.5 < float(model) < 2.0 and 0.5 < float(baseline) < 2.0  # test RMSE, and predicting the DP mean
        assert float(gap) == pytest.approx(float(model) - float(baseline), abs=2e-4)
    assert "a synthetic movielens log of 300 users" in out
    assert not [name for name in os.listdir(tmp_path) if name.startswith("ssp-forecast-")]  # TensorFlow's are its own
    assert os.listdir(budget_account_registry) == [] and sorted(os.listdir(own)) == ["run.toml"]


def test_the_forecast_warns_when_the_requested_epsilon_is_below_or_within_noise_of_the_baseline():
    def result(model, baseline, protocol="recall"):
        rows = [{"epsilon": e, "covered": 10, "model": model, "baseline": baseline} for e in (0.5, 1.0, 2.0)]
        return {"like": "plays", "users": 3500, "items": 1000, "rows": rows, "protocol": protocol}

    assert "WARNING" not in forecast.describe(result(0.20, 0.15), 1.0, None)
    near = forecast.describe(result(0.155, 0.15), 1.0, None)  # +0.005: within one run's noise (0.01)
    assert "WARNING: at epsilon 1 the model is forecast within the forecast's noise of DP popularity (+0.0050" in near
    below = forecast.describe(result(0.14, 0.15), 1.0, 2000)
    assert "WARNING: at epsilon 1 the model is forecast at or BELOW DP popularity (-0.0100)" in below
    assert "| 1 | 10 (1%) | 0.1400 | 0.1500 | -0.0100 |" in below and "your catalog of 2,000" in below
    worse_rmse = forecast.describe(result(1.02, 1.01, "rmse"), 1.0, None)  # RMSE: lower is better
    assert "BELOW predicting the DP mean (-0.0100)" in worse_rmse
    assert "WARNING" not in forecast.describe(result(0.95, 1.01, "rmse"), 1.0, None)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--data", "DATA", "--forecast-users", "300"],
            "--forecast-users, --forecast-history and --forecast-like go with --plan",
        ),
        (
            ["--plan", "--protocol", "rmse", "--forecast-users", "300", "--forecast-like", "plays"],
            "with --protocol recall",
        ),
        (
            ["--plan", "--protocol", "recall", "--forecast-users", "300", "--forecast-history", "20"],
            "log's histories are its own",
        ),
        (["--plan", "--forecast-history", "20"], "--forecast-history and --forecast-like go with --forecast-users"),
        (["--plan", "--non-private", "--forecast-users", "300"], "leave out --non-private"),
        (["--plan", "--forecast-users", "0"], "--forecast-users: expected a positive integer, got '0'"),
    ],
)
def test_misplaced_forecast_flags_are_one_line(tmp_path, capsys, flags, message):
    """Each refusal in this process (nothing printed on stdout: the plan too is refused; argparse's
    own refusal exits)."""
    try:
        code = cli.main(["train", *[str(tmp_path) if flag == "DATA" else flag for flag in flags]])
    except SystemExit as exit:
        code = exit.code
    assert code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and message in captured.err.strip().splitlines()[-1]


def test_a_misplaced_forecast_flag_is_one_line_from_the_installed_command():
    installed = os.path.join(os.path.dirname(sys.executable), "ssp")
    argv = [installed, "train", "--plan", "--protocol", "rmse", "--forecast-users", "300", "--forecast-like", "plays"]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "" and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "ssp train: error: --forecast-like plays is a play log (implicit feedback): forecast it with --protocol recall"
    )
