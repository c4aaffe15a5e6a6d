"""`ssp train`'s settings: `--config FILE` the same as the flags, flags over the file, a run's manifest fed back;
defaults that follow the mode."""

import json
import os
import subprocess
import sys

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
        json.dumps({"config": {k: v for k, v in config.flags().items() if k != "out"}, "steps_done": []})
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
    assert settings.TrainConfig.create().outer_steps == 1  # ratings, AM-SSP, biases: one release at the whole budget
    assert (
        settings.TrainConfig.create(biases=False).outer_steps
        == settings.TrainConfig.create(protocol="recall").outer_steps
        == release.DEFAULT_OUTER_STEPS
        == 2
    )
    assert (
        settings.TrainConfig.create(item_update="dpsgd").outer_steps
        == settings.TrainConfig.create(item_update="als", encoder="id").outer_steps
        == 2
    )
    assert settings.TrainConfig.create(non_private=True).outer_steps == settings.NON_PRIVATE_OUTER_STEPS
    assert settings.TrainConfig.create(outer_steps=3).outer_steps == 3


def test_a_ranked_users_fold_in_has_its_own_gravity():
    """The fold-in of a user to be ranked (evaluation, ssp recommend, serving) weighs the unobserved
    items at FOLD_IN_GRAVITY where the model has a gravity at all; training's users keep --gravity."""
    recall = settings.TrainConfig.create(protocol="recall")
    assert (recall.gravity, recall.fold_in_gravity) == (
        0.1,
        settings.FOLD_IN_GRAVITY,
    ) and settings.FOLD_IN_GRAVITY == 1.0
    assert (
        settings.TrainConfig.create(protocol="recall", gravity=0.0).fold_in_gravity == 0.0
    )  # no gravity model: none in its fold-in
    assert settings.TrainConfig.create(protocol="recall", fold_in_gravity=0.3).fold_in_gravity == 0.3
    assert settings.TrainConfig.create(protocol="rmse").fold_in_gravity == 0.0
    exact = settings.TrainConfig.create(protocol="recall", non_private=True)  # implicit ALS's weights
    assert (
        (exact.gravity, exact.fold_in_gravity) == (settings.NON_PRIVATE_GRAVITY, settings.FOLD_IN_GRAVITY) == (1.0, 1.0)
    )
    assert parsed("--protocol", "recall", "--fold-in-gravity", "2").fold_in_gravity == 2.0
    with pytest.raises(ValueError, match="--fold-in-gravity must be >= 0"):
        settings.TrainConfig.create(protocol="recall", fold_in_gravity=-1.0)


def test_a_non_private_ratings_run_holds_its_residuals_harder():
    """Without noise nothing else shrinks a rare item's fit: NON_PRIVATE_RESIDUAL_PENALTY, not 3."""
    rated = settings.TrainConfig.create(protocol="rmse", non_private=True)
    assert rated.residual_penalty == settings.NON_PRIVATE_RESIDUAL_PENALTY == 10.0
    assert settings.TrainConfig.create(protocol="rmse").residual_penalty == 3.0
    assert settings.TrainConfig.create(protocol="recall", non_private=True).residual_penalty == 0.1


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
    older = {key: value for key, value in config.flags().items() if key not in ("out", "fold_in_gravity")}
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


def test_a_config_file_with_sections_round_trips(tmp_path):
    config = parsed("--protocol", "recall", "--epsilon", "3", "--dim", "24", "--no-popularity-column", "--shards", "2")
    (tmp_path / "run.toml").write_text(config.toml())
    assert "[budget]\nepsilon = 3.0" in config.toml() and "[users]" in config.toml()
    assert parsed("--config", str(tmp_path / "run.toml")) == config
    (tmp_path / "hand.toml").write_text('[budget]\nepsilon = 5\n\n[model]\nitem-update = "dpsgd"\ndim = 16\n')
    assert parsed("--config", str(tmp_path / "hand.toml")) == parsed(
        "--epsilon", "5", "--item-update", "dpsgd", "--dim", "16"
    )


@pytest.mark.parametrize(
    "text, problem",
    [
        ("[model]\nepsilon = 5\n", "epsilon belongs in [budget], not [model]"),
        ("[budget]\nepsilom = 5\n", "unknown setting 'epsilom'"),
        ("budget = 5\n", "[budget] must be a table of settings"),
        ("[ssp]\nepochs = 2.5\n", "epochs must be int"),
    ],
)
def test_a_bad_section_is_refused_naming_the_file_and_the_setting(tmp_path, text, problem):
    (tmp_path / "run.toml").write_text(text)
    with pytest.raises(ValueError) as refused:
        settings.read_config(str(tmp_path / "run.toml"))
    assert f"--config {tmp_path / 'run.toml'}" in str(refused.value) and problem in str(refused.value)


def test_every_setting_is_declared_once_with_its_help_range_and_flag():
    """The sections' fields are the settings: each has help, a flag of its name, a type the
    loader and the CLI read from its annotation, and a default of None only with its rule."""
    from pipelines.training import sections

    declared = [name for cls in sections.SECTIONS.values() for name in cls.__dataclass_fields__]
    assert len(declared) == len(set(declared)) == len(sections.FLAGS) == 68
    actions = {
        action.dest: action for action in cli.build_parser()._subparsers._group_actions[0].choices["train"]._actions
    }
    for name, flag in sections.FLAGS.items():
        assert flag.help and flag.kind in (bool, int, float, str), name
        assert flag.field.default is not None or flag.rule or name in ("seed_file",) or flag.optional, name
        assert actions[name].option_strings == [flag.flag] or actions[name].option_strings[0] == flag.flag
        assert flag.help.split(" (")[0][:40].replace("%", "%%") in actions[name].help, name
    for name, _ in settings.RULES:  # every rule fills a setting whose default is None and says so
        assert sections.FLAGS[name].field.default is None and sections.FLAGS[name].rule, name


@pytest.mark.parametrize(
    "name, bad, message",
    [
        ("dim", 0, "--dim must be a positive integer, got 0"),
        ("split_seed", -1, "--split-seed must be a non-negative integer, got -1"),
        ("learning_rate", 0.0, "--learning-rate must be > 0, got 0.0"),
        ("anchor", -0.5, "--anchor must be >= 0, got -0.5"),
        ("holdout", 1.0, "--holdout must be a number in [0, 1), got 1.0"),
        ("train_item_fraction", 0.0, "--train-item-fraction must be a number in (0, 1], got 0.0"),
        ("ridge", float("nan"), "--ridge must be a finite number, got nan"),
        ("epochs", True, "--epochs must be a positive integer, got True"),
        ("encoder", "ids", "--encoder must be one of ('features', 'id'), got 'ids'"),
    ],
)
def test_a_setting_outside_its_declared_range_is_refused_naming_the_flag(name, bad, message):
    with pytest.raises(ValueError) as refused:
        settings.TrainConfig.create(**{name: bad})
    assert str(refused.value) == message


def test_defaults_are_chosen_by_a_pure_function_and_replace_chooses_them_again():
    raw = settings.TrainConfig().with_settings(protocol="recall", epsilon=5.0)
    assert raw.dim is None and raw.gravity is None  # as given: nothing chosen yet
    chosen = settings.resolved(raw)
    assert raw.dim is None and (chosen.dim, chosen.gravity, chosen.fold_in_gravity) == (16, 0.1, 1.0)
    assert settings.resolved(chosen) == chosen  # a chosen setting stays as it is
    assert chosen.replace(epsilon=20.0).dim == 16  # kept: it is a setting of the run now
    assert chosen.replace(epsilon=20.0, dim=None).dim == 32  # None: its rule chooses it again
    with pytest.raises(TypeError, match="no setting 'epsilom'"):
        settings.TrainConfig.create(epsilom=5)


def test_d_is_left_to_the_item_grams_release_only_where_dim_is_not_given():
    """--dim-from-item-gram: on by its rule unless --dim is given; it applies where a trained item
    update starts from the item Gram (a private ranking AM-SSP), and raises d to 32 from 64 kept directions."""
    chosen = settings.TrainConfig.create(protocol="recall", epsilon=5.0)
    assert chosen.dim_from_item_gram and settings.dim_chosen_by_item_gram(chosen)
    assert not settings.TrainConfig.create(protocol="recall", epsilon=5.0, dim=16).dim_from_item_gram
    assert not settings.dim_chosen_by_item_gram(settings.TrainConfig.create(protocol="recall", non_private=True))
    assert not settings.dim_chosen_by_item_gram(settings.TrainConfig.create(epsilon=5.0))  # ratings: no Gram
    assert [settings.raised_dim(16, kept) for kept in (0, 63, 64, 500)] == [16, 16, 32, 32]
    assert settings.raised_dim(32, 3) == 32 and settings.raised_dim(64, 500) == 64  # raised only


def test_the_library_sets_no_attribute_of_a_frozen_object():
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    offenders = [
        str(path.relative_to(root))
        for package in ("schemas", "privacy", "trainer", "pipelines", "ssp", "bench")
        for path in (root / package).rglob("*.py")
        if "object.__setattr__" in path.read_text()
    ]
    assert not offenders


def test_the_cli_reference_is_generated_from_the_parsers_and_settings():
    """docs/cli.md's reference is `python -m ssp.reference docs/cli.md`'s output: it lists every
    command and every `ssp train` setting under its section, with the help its field declares."""
    from pathlib import Path

    from pipelines.training import sections
    from ssp import reference

    page = (Path(__file__).resolve().parents[3] / "docs" / "cli.md").read_text()
    assert reference.updated(page) == page, "docs/cli.md is stale: run `python -m ssp.reference docs/cli.md`"
    for section in sections.SECTIONS:
        assert f"**[{section}]**" in page
    for flag in sections.FLAGS.values():
        assert f"| `{flag.flag}`" in page
