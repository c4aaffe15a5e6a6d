"""`ssp train`'s settings: `--config FILE` the same as the flags, flags over the file, a run's manifest fed back; defaults that follow the mode."""

import json
import os
import subprocess
import sys
from dataclasses import asdict

import pytest

from pipelines.releases import release
from pipelines.training import commands, settings
from ssp import cli


def parsed(*argv: str) -> settings.TrainConfig:
    """The run settings `ssp train ARGV` would use (as cli.main parses them)."""
    argv = ["train", *argv]
    args = cli.build_parser().parse_args(argv)
    if args.config:
        args.explicit = cli._given_flags(argv)
    return commands.config_from_args(args)


def test_a_config_file_equals_the_same_flags(tmp_path):
    (tmp_path / "run.toml").write_text(
        'epsilon = 5\ndelta = 1e-6\nitem-update = "dpsgd"\nouter_steps = 3\nnon-private = false\n'
        'psd-projection = false\ndim = 16\nout = "runs/x"\n'
    )
    by_flags = parsed(
        "--epsilon",
        "5",
        "--delta",
        "1e-6",
        "--item-update",
        "dpsgd",
        "--outer-steps",
        "3",
        "--no-psd-projection",
        "--dim",
        "16",
        "--out",
        "runs/x",
    )
    assert parsed("--config", str(tmp_path / "run.toml")) == by_flags
    assert by_flags != parsed()  # the settings are not the defaults


def test_flags_override_the_file_even_when_they_repeat_a_default(tmp_path):
    (tmp_path / "run.toml").write_text("epsilon = 5\nouter-steps = 3\n")
    config = parsed(
        "--config", str(tmp_path / "run.toml"), "--outer-steps", "2"
    )  # 2 is the default: given, it still wins
    assert (config.epsilon, config.outer_steps) == (5.0, 2)


def test_a_runs_manifest_fed_back_gives_the_same_settings(tmp_path):
    config = parsed("--epsilon", "3", "--protocol", "recall", "--gravity", "0.2", "--out", str(tmp_path / "a"))
    manifest = tmp_path / "manifest.json"
    manifest.write_text(
        json.dumps({"config": {k: v for k, v in asdict(config).items() if k != "out"}, "steps_done": []})
    )
    again = parsed("--config", str(manifest), "--out", str(tmp_path / "a"))
    assert again == config


@pytest.mark.parametrize(
    "text, problem",
    [
        ("epsilon = 'five'\n", "epsilon must be float"),
        ("epsilom = 5\n", "unknown setting 'epsilom'"),
        ("dim = 2.5\n", "dim must be int"),
        ("non-private = 1\n", "non-private must be bool"),
        ("epsilon = \n", "is not TOML"),
    ],
)
def test_a_bad_config_is_refused_naming_the_file_and_the_setting(tmp_path, capsys, text, problem):
    (tmp_path / "run.toml").write_text(text)
    assert cli.main(["train", "--config", str(tmp_path / "run.toml"), "--out", str(tmp_path / "run")]) == 2
    error = capsys.readouterr().err
    assert f"--config {tmp_path / 'run.toml'}" in error and problem in error
    assert not (tmp_path / "run").exists()


def test_am_ssp_with_biases_releases_its_statistics_once_by_default():
    assert settings.TrainConfig().outer_steps == 1  # ratings, AM-SSP, biases: one release at the whole budget
    assert (
        settings.TrainConfig(biases=False).outer_steps
        == settings.TrainConfig(protocol="recall").outer_steps
        == release.DEFAULT_OUTER_STEPS
        == 2
    )
    assert (
        settings.TrainConfig(item_update="dpsgd").outer_steps
        == settings.TrainConfig(item_update="als", encoder="id").outer_steps
        == 2
    )
    assert settings.TrainConfig(non_private=True).outer_steps == settings.NON_PRIVATE_OUTER_STEPS
    assert settings.TrainConfig(outer_steps=3).outer_steps == 3


def test_a_ranked_users_fold_in_has_its_own_gravity():
    """The fold-in of a user to be ranked (evaluation, ssp recommend, serving) weighs the unobserved
    items at FOLD_IN_GRAVITY where the model has a gravity at all; training's users keep --gravity."""
    recall = settings.TrainConfig(protocol="recall")
    assert (recall.gravity, recall.fold_in_gravity) == (
        0.1,
        settings.FOLD_IN_GRAVITY,
    ) and settings.FOLD_IN_GRAVITY == 1.0
    assert (
        settings.TrainConfig(protocol="recall", gravity=0.0).fold_in_gravity == 0.0
    )  # no gravity model: none in its fold-in
    assert settings.TrainConfig(protocol="recall", fold_in_gravity=0.3).fold_in_gravity == 0.3
    assert settings.TrainConfig(protocol="rmse").fold_in_gravity == 0.0
    assert parsed("--protocol", "recall", "--fold-in-gravity", "2").fold_in_gravity == 2.0
    with pytest.raises(ValueError, match="--fold-in-gravity must be >= 0"):
        settings.TrainConfig(protocol="recall", fold_in_gravity=-1.0)


def test_a_negative_fold_in_gravity_is_one_line_through_the_installed_command(tmp_path):
    installed = os.path.join(os.path.dirname(sys.executable), "ssp")
    result = subprocess.run(
        [
            installed,
            "train",
            "--data",
            str(tmp_path),
            "--protocol",
            "recall",
            "--fold-in-gravity",
            "-1",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.strip().splitlines()[-1] == "ssp train: error: --fold-in-gravity must be >= 0, got -1.0"
    assert not (tmp_path / "run").exists()


def test_a_run_started_before_a_setting_existed_is_refused_naming_it(tmp_path):
    """Resuming a run folder whose manifest lacks a setting this version has is refused, as any
    other settings are, and the error says the setting is newer than the run."""
    from pipelines.training.prepare import _check_manifest
    from pipelines.training.run_dir import Run

    config = parsed("--protocol", "recall", "--out", str(tmp_path / "run"))
    older = {key: value for key, value in asdict(config).items() if key not in ("out", "fold_in_gravity")}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({"config": older, "steps_done": []}))
    with pytest.raises(
        ValueError,
        match=r"other settings \(fold_in_gravity; fold_in_gravity did not exist in the version that started it\)",
    ):
        _check_manifest(Run(str(tmp_path / "run")), config)
    (tmp_path / "run" / "manifest.json").write_text(
        json.dumps({"config": {**older, "fold_in_gravity": 1.0}, "steps_done": []})
    )
    assert (
        _check_manifest(Run(str(tmp_path / "run")), config)["config"]["fold_in_gravity"] == 1.0
    )  # the same settings: resumed
