"""The training commands: `ssp train` (all stages, or `--stage prepare`), `ssp item-update` and
`ssp evaluate`: their flags, a configuration file's settings (`--config`), and their handlers.

Privacy: settings only; the stages they run hold the privacy logic.
"""

from __future__ import annotations

import argparse

from pipelines.base import logs
from pipelines.data.synth import positive_int
from pipelines.training.evaluation import describe, evaluate
from pipelines.training.item_update import item_update
from pipelines.training.prepare import prepare, run_directory
from pipelines.training.run_dir import Run, existing_run_lock
from pipelines.training.sections import FLAGS
from pipelines.training.settings import STAGES, TrainConfig, read_config
from pipelines.training.stages import run
from pipelines.training.stats_stage import run_engine
from schemas import storage
from schemas.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ssp train` flags: one per setting, with the help, choices and default its field declares
    (pipelines.training.sections)."""
    for name, flag in FLAGS.items():
        default = None if name == "data" else flag.field.default  # --data: required (`check_data`)
        text = flag.help.replace("%", "%%")
        if name != "data":
            text += f" (default: {flag.rule.replace('%', '%%') if flag.rule else '%(default)s'})"
        if flag.kind is bool:
            action = argparse.BooleanOptionalAction if default is not False else "store_true"
            parser.add_argument(flag.flag, action=action, default=default, help=text)
        else:
            parser.add_argument(flag.flag, type=flag.kind, default=default, choices=flag.choices, help=text)
    parser.add_argument(
        "--config",
        help="a file of settings, one per flag, in the sections of docs/cli.md (TOML: `[budget]` then `epsilon = 5`, "
        'or flat: `item-update = "ssp"`; or JSON, such as a run\'s manifest.json, whose settings are fed back): flags '
        "given on the command line override it",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print what the run would release (each release's noise multiplier and standard "
        "deviation, the budget split, the DP count an item needs to rise above the noise) and stop: nothing private is "
        "read, "
        "nothing is spent",
    )
    parser.add_argument(
        "--forecast-users",
        type=positive_int,
        metavar="N",
        help="with --plan: also forecast the quality, from a synthetic log of N users run through the same pipeline "
        "at half, the requested and twice the epsilon (items with statistics, the test metric against DP popularity "
        "or the DP mean; minutes, nothing spent)",
    )
    parser.add_argument(
        "--forecast-history",
        type=positive_int,
        metavar="L",
        help="with --forecast-users and a MovieLens-like log: the users' mean history length (default: the "
        "generator's, MovieLens-1M's 166)",
    )
    parser.add_argument(
        "--forecast-like",
        choices=("movielens", "plays"),
        help="with --forecast-users: the synthetic log's generator (default: plays for --protocol recall, movielens "
        "for ratings)",
    )
    add_metrics_at(parser)
    parser.add_argument(
        "--stage",
        choices=STAGES,
        default="all",
        help="all: the whole run in this process (default); prepare: only the first stage, recording these settings in "
        "OUT/manifest.json for the stage commands (user-update, stats, item-update, evaluate) that a scheduler runs",
    )


def add_stage_arguments(parser: argparse.ArgumentParser, step: bool) -> None:
    """The flags of a stage command: the run directory (everything else comes from its manifest)."""
    parser.add_argument(
        "--run", required=True, help="run directory prepared by `ssp train --stage prepare` (local or gs://)"
    )
    if step:
        parser.add_argument("--step", type=int, required=True, help="outer step s (1..S)")


def add_metrics_at(parser: argparse.ArgumentParser) -> None:
    """`--metrics-at` of `ssp train` and `ssp evaluate`."""
    parser.add_argument(
        "--metrics-at",
        type=metrics_at,
        default=(),
        metavar="K,...",
        help="a ranking run: also Recall, Precision, NDCG, MAP and catalog coverage at each cut-off k, the model's "
        "and DP popularity's (e.g. 10,20,50; default: the protocol's Recall@20, Recall@50, NDCG@100 and "
        "coverage@20 only)",
    )


def metrics_at(text: str) -> tuple[int, ...]:
    """`--metrics-at`'s cut-offs: positive integers separated by commas."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(f"must be positive integers separated by commas (e.g. 10,20,50), got {text!r}")
    return tuple(sorted({int(part) for part in parts}))


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's settings: the flags, over the --config file's settings (args.explicit: the flags
    given on the command line), over the defaults."""
    values = {name: getattr(args, name) for name in FLAGS}
    if getattr(args, "config", None):
        given = getattr(args, "explicit", set())
        values.update({name: value for name, value in read_config(args.config).items() if name not in given})
    if (
        values["data"] is None
    ):  # not given: TrainConfig's own default (`ssp train` itself refuses that, see `check_data`)
        del values["data"]
    return TrainConfig.create(**values)


def check_data(args: argparse.Namespace) -> None:
    """`ssp train` needs its data named (only `ssp demo` runs on the bundled set), as a folder: a CSV
    log is told to go through `ssp ingest` first. Checked before any engine starts."""
    data = (
        args.data
        if args.data is not None
        else read_config(args.config).get("data")
        if getattr(args, "config", None)
        else None
    )
    if data is None:
        raise UserError(
            "--data is required: a data set folder (`ssp ingest`, `ssp synth`) or a MovieLens folder; `ssp demo` runs "
            "on the "
            "bundled ml-latest-small"
        )
    fs, inner = storage.filesystem(data)
    if fs.isfile(inner):
        raise UserError(
            f"--data {data} is a file: training reads a data set folder; turn an interaction log into one with `ssp "
            "ingest "
            f"--interactions {data} --catalog ITEMS --features ... --out FOLDER`"
        )


# The run's own resources, never a forecast's: its data source, seed file and budget account.
NOT_FORECAST = (
    "data_source",
    "shares_users_with",
    "seed_file",
    "budget_account",
    "account_cap",
    "account_window_days",
)


def check_forecast(args: argparse.Namespace, config: TrainConfig) -> None:
    """The forecast flags' refusals (pipelines.training.forecast.checked), before the plan prints."""
    from pipelines.training import forecast

    if not args.forecast_users:
        raise UserError("--forecast-history and --forecast-like go with --forecast-users")
    if config.non_private:
        raise UserError("--forecast-users forecasts a private run's quality: leave out --non-private")
    forecast.checked(config.epsilon, config.protocol, args.forecast_history, args.forecast_like)


def forecast_of(args: argparse.Namespace, config: TrainConfig, catalog: int | None) -> str:
    """`--plan --forecast-users`: the run's settings, each rule applied again at each epsilon, on the
    forecast's synthetic log (pipelines.training.forecast)."""
    import copy

    from pipelines.training import forecast

    def config_at(epsilon: float, data: str, out: str) -> TrainConfig:
        own = {"epsilon": epsilon, "data": data, "out": out, "engine": "local", **dict.fromkeys(NOT_FORECAST)}
        at = copy.copy(args)
        for name, value in own.items():
            setattr(at, name, value)
        at.explicit = set(getattr(args, "explicit", set())) | set(own)  # over a --config file's settings too
        return config_from_args(at)

    logs.log(f"forecast: a synthetic log of {args.forecast_users:,} users, 3 runs (this takes a while)")
    result = forecast.forecast(
        config_at, config.epsilon, config.protocol, args.forecast_users, args.forecast_history, args.forecast_like
    )
    return forecast.describe(result, config.epsilon, catalog)


def main(args: argparse.Namespace) -> int:
    if args.plan:  # the settings and the public catalog's size only: --data may be left out
        from pipelines.data.datasets import is_dataset, open_dataset
        from pipelines.training import plan

        data = args.data
        catalog = open_dataset(data).manifest.get("items") if data and is_dataset(data) else None
        config = config_from_args(args)
        if args.forecast_users or args.forecast_history or args.forecast_like:  # refused before anything is printed
            check_forecast(args, config)
        print(plan.describe(config, catalog), flush=True)
        if args.forecast_users:
            print(forecast_of(args, config, catalog))
        return 0
    if args.forecast_users or args.forecast_history or args.forecast_like:
        raise UserError("--forecast-users, --forecast-history and --forecast-like go with --plan")
    check_data(args)
    config = config_from_args(args)
    if args.stage == "prepare":
        with (
            run_directory(config),
            run_engine(Run(config.out), config, app="ssp-prepare") as engine,
        ):  # Spark: started only for a log too large for this process
            prepare(config, engine=engine)
        print(f"prepared {config.out}; next: `ssp user-update --run {config.out} --step 1`")
        return 0
    print(describe(run(config, metrics_at=args.metrics_at)))
    return 0


def item_update_main(args: argparse.Namespace) -> int:
    """`ssp item-update --run RUN --step s`."""
    with existing_run_lock(args.run):
        manifest = item_update(Run(args.run), args.step)
    print(f"outer step {args.step} of {args.run} done (steps done: {manifest['steps_done']})")
    return 0


def evaluate_main(args: argparse.Namespace) -> int:
    """`ssp evaluate --run RUN`."""
    with existing_run_lock(args.run):
        metrics = evaluate(Run(args.run), args.metrics_at)
    print(describe(metrics))
    return 0
