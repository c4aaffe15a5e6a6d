"""The training commands: `ssp train` (all stages, or `--stage prepare`), `ssp item-update` and
`ssp evaluate`: their flags, a configuration file's settings (`--config`), and their handlers.

Privacy: settings only; the stages they run hold the privacy logic.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from pipelines.data import splits
from pipelines.releases.release import DEFAULT_OUTER_STEPS
from pipelines.releases.stats_core import LOSSES
from pipelines.training.evaluation import describe, evaluate
from pipelines.training.item_update import item_update
from pipelines.training.prepare import prepare, run_directory
from pipelines.training.run_dir import Run, existing_run_lock
from pipelines.training.settings import (
    ENCODER_INITS,
    ENGINES,
    ITEM_UPDATES,
    NON_PRIVATE_OUTER_STEPS,
    STAGES,
    TrainConfig,
    read_config,
)
from pipelines.training.stages import run
from pipelines.training.stats_stage import run_engine
from schemas import storage
from schemas.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`ssp train` flags: one per TrainConfig field."""
    helps = {
        "data": "data set folder (written by `ssp ingest` or `ssp synth`) or MovieLens folder; required (`ssp demo` runs on the bundled "
        "ml-latest-small)",
        "protocol": "rmse (80/10/10 ratings split, RMSE) or recall (held-out users, Recall@20)",
        "positive_threshold": "--protocol recall: labels above it are the positives (default: the top 30%% of the rating scale, 3.65 on 0.5..5 "
        "stars; implicit feedback keeps every interaction)",
        "confidence_alpha": "implicit feedback: a (user, item) pair that came n times (plays, clicks) weighs c = (1 + alpha log(1 + n)) / "
        "(1 + alpha log 2) in its user's fit and, within the user's weight budget (the sensitivity unchanged), in the "
        "statistics (Hu, Koren and Volinsky's confidence; c = 1 for one interaction); 0 counts a repeat once",
        "rating_min": "lowest rating: the DP mean's clipping bound and the predictions' floor (default: the data set's declared "
        "rating scale, see `ssp ingest --rating-scale`; 0.5 for data that declares none)",
        "rating_max": "highest rating: the DP mean's other clipping bound and the predictions' ceiling (default: the data set's declared "
        "rating scale; 5 for data that declares none)",
        "out": "run directory (local or gs://)",
        "epsilon": "target epsilon of the whole run, every release included (user level: what one user's whole history can change); "
        "the noise is calibrated to spend exactly this",
        "delta": "target delta of the whole run: the chance, beyond epsilon, that the guarantee fails; keep it below 1/(number of users)",
        "outer_steps": "outer steps S of alternating minimization (user update, then item update from newly released statistics); "
        "each step is one more release, so more steps mean more noise per release at the same epsilon (default: "
        f"1 for AM-SSP on ratings with biases, whose item biases gain most from one release at the whole budget; {DEFAULT_OUTER_STEPS} "
        f"for the other updates; {NON_PRIVATE_OUTER_STEPS} for --non-private, which has no budget to split; 1 for --item-update "
        "item-mean, whose users never change)",
        "resamples": "independently noised copies R of each statistics release (the paper's SSP1); the budget is split among them",
        "clip_u": "Gamma_u: each user embedding is clipped to this L2 norm before it enters the statistics (item embeddings have unit "
        "RMS norm); with --wbar it bounds what one user adds to A_j, and so the noise",
        "clip_y": "Gamma_y: each centred label is clipped to [-Gamma_y, Gamma_y] before it enters b_j; with --clip-u and --wbar it bounds "
        "what one user adds to b_j (default: 1.5 for --protocol rmse, in the centred labels' units: a smaller clip pulls "
        "every item's mean towards 0; 1 for recall, whose labels are 1)",
        "wbar": "bound on each user's weights: their squares sum to wbar^2 over the user's items, so one user moves A by at most wbar "
        "Gamma_u^2 and b by wbar Gamma_y Gamma_u whatever the length of their history",
        "max_items_per_user": "at most this many of a user's items count in the DP item counts (the first release): bounds the counts' "
        "sensitivity to sqrt of this",
        "count_share": "share of the run's privacy budget spent on the DP item counts (the weights, the stats threshold and the "
        "encoder's start come from them)",
        "mean_share": "share of the budget spent on the DP mean rating (--protocol rmse: labels are centred by it)",
        "gram_share": "share of the budget spent on the users' DP Gram matrix (--gravity > 0, implicit feedback)",
        "lambda_u": "ridge of the user update per rating: u = (sum v v^T + (lambda_u n + --user-prior) I)^-1 sum y v over the user's n ratings; "
        "users are solved privately on the trusted side, so it has no privacy effect (default: 0.01 with biases, else 0.1)",
        "user_prior": "the user ridge's fixed part, a prior precision on the embedding in the units of the unit-RMS item vectors: it "
        "weighs most for the users with fewest ratings (trusted side: no privacy effect; default: 20 with biases, else 0)",
        "epochs": "AM-SSP: passes of the item trainer over the released statistics in each item update (post-processing: no privacy effect)",
        "batch_size": "AM-SSP: items per minibatch of the item trainer (default: the covered catalog over 8, at least 512: an epoch of "
        "about 8 steps, as the defaults were tuned with; each step updates every item's residual, so small batches on a "
        "large catalog cost time without gaining accuracy)",
        "learning_rate": "AM-SSP: Adam learning rate of the item trainer",
        "ridge": "ridge lambda of the item update in units of the most one user adds to an item's statistics (S): lambda S I is added to "
        "every A_j",
        "noise_ridge": "extra ridge of the item update in units of the noise's spectral norm (N): noise_ridge N I is added to every A_j, "
        "which keeps the noised A_j positive definite and items with little signal near their start",
        "psd_projection": "project each noised A_j onto the positive semi-definite cone before training on it (free post-processing)",
        "feature_ridge": "DP-CMF: ridge of the feature embeddings",
        "cmf_iterations": "DP-CMF: alternating item / feature solves in each outer step",
        "dpsgd_epochs": "AM-DPSGD: expected passes over the users in each item update (more epochs: more DP-SGD steps, more noise per step)",
        "dpsgd_learning_rate": "AM-DPSGD: learning rate of DP-SGD",
        "dpsgd_max_rows_per_user": "AM-DPSGD: at most this many of a user's rows form the user's example, whose gradient is clipped",
        "split_seed": "seed of the train/valid/test split (the split is per user or per rating by a keyed hash: one user's rows never "
        "move another's)",
        "model_seed": "seed of the encoder's initialisation and the item trainer's shuffling (not of the noise: that comes from the "
        "secret seed file)",
        "shards": "part files per statistics table, the parallelism of the stats job's write",
        "non_private": "no noise and no clipping: the non-private top line of the same pipeline",
        "seed_file": "a secret noise seed file for a new run (default: RUN/private/seed, from the OS CSPRNG); a seed file serves one "
        "run's ledger: another run's is refused (to reproduce a run, copy its folder)",
        "engine": "engine of the run's row work (the prepare stage, the user updates, the stats releases): spark, beam, or local "
        "(this process, no JVM: small logs); or federated: Beam's, with each step's statistics released by "
        "simulated devices (solving their own embeddings) through secure aggregation with distributed Skellam noise "
        "(pipelines.engines.federated; accountant: RDP on integer orders). A log under 2M rows is prepared locally on any engine",
        "federated_dropout": "--engine federated: share of clients that drop out of each round after its setup (simulated; their masks are "
        "recovered from their neighbours' Shamir shares)",
        "federated_server": "--engine federated: the simulated server, honest, or partition: a malicious server showing holders different "
        "survivor sets to unmask one client (a drill: the consistency check refuses the round, nothing is published)",
        "federated_max_dropout": "--engine federated: the noise shares are planned for this share of clients missing, and never fewer "
        "than a majority of the clients answering (the consistency check's quorum); a round with more dropouts is "
        "refused",
        "loss": "square (the paper's AM-SSP) or logistic: SSP-convex for implicit feedback (--protocol recall): each step releases the "
        "logistic loss's H_j, g_j around the step's starting item embeddings, every user's positives against every item as a "
        "negative, and the SSP2 trainer descends that quadratic approximation; users are solved with the same loss (Spark engine)",
        "item_update": "item update: ssp (AM-SSP: SSP2 trainer of the encoder), als (DP-ALS) or cmf (DP-CMF: public features as un-noised rows), "
        "closed-form solves from the same statistics with --encoder id, or dpsgd (AM-DPSGD: TF-Privacy DP-SGD on the rows, no statistics; "
        "its budget share is the statistics', and it ignores --gravity in the item update), item-mean (the DP per-item mean: "
        "each item's clipped, weighted label sum and count, noised and shrunk to the DP mean, with --encoder id; the baseline "
        "every model must beat), or none (the starting point: the public-feature encoder as initialised, users fitted to it; "
        "no statistics released)",
        "feature_weight": "DP-CMF: weight mu of the public feature rows (0: DP-ALS)",
        "dpsgd_batch_size": "AM-DPSGD: expected users per DP-SGD step",
        "dpsgd_clip": "AM-DPSGD: per-user gradient clip norm",
        "encoder": "features (public feature families + item id) or id (one embedding per item)",
        "encoder_init": "the features encoder's start (and the starting point every item update is held near): principal (the top-d principal "
        "directions of the public feature vectors, items weighted by their DP counts: free post-processing) or random",
        "popularity_column": "--protocol recall: a user folded in from their history also gets a coefficient on the items' DP counts "
        "(a public release: no privacy cost), so where the noise leaves the trained directions little signal the "
        "ranking falls back on popularity; ssp recommend does the same (default: on)",
        "item_id_feature": "the features encoder adds a free per-item residual to what the public features say, held at zero by "
        "--residual-penalty until the item's statistics outweigh the noise (default: on)",
        "anchor": "how strongly each item update holds the shared features encoder near where it began (its starting point), in the same "
        "units as --residual-penalty: larger keeps the model at its public-feature start when the statistics are mostly noise",
        "residual_penalty": "penalty on each item's residual, in units of the most one user adds to an item's statistics plus the "
        "noise's spectral norm: larger keeps rare items at their public features",
        "biases": "user and item biases: the prediction is DP mean + b_u + b_j + u.v, each user's bias solved with the user's embedding, each "
        "item's fitted with its embedding from the statistics (a constant coordinate appended to the clipped user vector) "
        "(default: on for --protocol rmse with every item update; the federated engine has none yet). With --protocol recall "
        "(off by default) the items' biases only, learned with the gravity; every user's bias is held at 0",
        "bias_coordinate": "the constant c appended to each clipped user vector so that the statistics carry each item's bias, in units of "
        "--clip-u: it raises the statistics' sensitivity (and noise) by sqrt(1 + c^2), and gives the item biases a share c^2 / (1 + c^2) "
        "of it (default: min(2, sqrt(20 / epsilon)): 2 up to epsilon 5, where noise blurs the embedding most, 1 at 20)",
        "lambda_bias": "ridge of each user's bias, a pseudo-count of zero residuals: a user with few ratings keeps a bias near 0 "
        "(trusted side: no privacy effect; default: %(default)s)",
        "dim": "embedding dimension d (default: 32 for --non-private runs; private: for --protocol rmse 8 below --epsilon 5, 16 from 5; for recall 16 below "
        "--epsilon 10, 32 from 10)",
        "weight_exponent": "exponent e of the user-level weights w = wbar n_j^e / sqrt(sum over the user's items of n^2e), n_j the item's "
        "DP count (default: -0.25, towards rare items, for --protocol rmse; 0, even, for recall)",
        "holdout": splits.HOLDOUT_HELP,
        "budget_account": "where a new budget account of the data source is kept (a JSON file): every release of every run on these users is "
        "charged there, so their lifetime epsilon is composed and capped. A data source (identified by the content of its "
        "interactions, wherever they are stored) has one account, found through the registry $SSP_BUDGET_ACCOUNTS (default "
        "~/.ssp/budget-accounts); a second one is refused (default: the registry's own)",
        "account_cap": "lifetime epsilon cap of a new budget account: a release that would take the users past it is refused (default: no cap, "
        "the lifetime epsilon is only reported)",
        "account_window_days": "renewal window of a new budget account: releases older than this many days stop counting against its cap "
        "(default: none, every release counts forever)",
        "gravity": "implicit-feedback weight alpha on the users' DP Gram matrix (default: 0.1 for --protocol recall, 0 for rmse)",
        "fold_in_gravity": "the gravity alpha of a user folded in to be ranked for (evaluation, ssp recommend, the served model; "
        "default: 1 where --gravity > 0, else --gravity)",
        "train_item_fraction": "--protocol recall: the statistics cover this share of the catalog, the items with the largest DP counts "
        "(default: 0.1 for --encoder id, whose rare items would be fitted to noise alone; 1 for features, "
        "whose rare items fall back on their features)",
        "stats_threshold": "the statistics cover the items whose DP count is at least this many times N/S (the count at which an item's "
        "data would match the noise in its A_j); the others keep what their public features say, and no user's weight "
        "is spent on them; 0: every item (default: 6 for --item-update ssp with the features encoder when the release's noise-to-"
        "signal ratio sqrt(m) (N/S) / sqrt(total DP count x DP users) exceeds 0.15 with --biases, 0.03 without; 1 otherwise)",
    }
    for item in fields(TrainConfig):
        name = "--" + item.name.replace("_", "-")
        default = (
            None if item.name == "data" else item.default
        )  # the declared default: None means "chosen per mode" (--data: required)
        kind_name = item.type if isinstance(item.type, str) else item.type.__name__
        if kind_name.startswith("bool") or isinstance(default, bool):
            action = argparse.BooleanOptionalAction if default is not False else "store_true"
            parser.add_argument(
                name, action=action, default=default, help=helps.get(item.name, item.name.replace("_", " "))
            )
            continue
        kind = {"int": int, "float": float}.get(kind_name.split(" ")[0], str)
        choices = {
            "protocol": splits.PROTOCOLS,
            "engine": ENGINES,
            "loss": LOSSES,
            "item_update": ITEM_UPDATES,
            "encoder": ("features", "id"),
            "encoder_init": ENCODER_INITS,
        }.get(item.name)
        text = helps.get(item.name, item.name.replace("_", " "))
        parser.add_argument(
            name,
            type=kind,
            default=default,
            choices=choices,
            help=text
            if "default:" in text or default is None and item.default is not None
            else f"{text} (default: %(default)s)",
        )
    parser.add_argument(
        "--config",
        help='a file of settings, one per flag (TOML: `epsilon = 5`, `item-update = "ssp"`; or JSON, such as '
        "a run's manifest.json, whose settings are fed back): flags given on the command line override it",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print what the run would release (each release's noise multiplier and standard "
        "deviation, the budget split, the DP count an item needs to rise above the noise) and stop: nothing private is read, "
        "nothing is spent",
    )
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


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The run's settings: the flags, over the --config file's settings (args.explicit: the flags
    given on the command line), over the defaults."""
    values = {item.name: getattr(args, item.name) for item in fields(TrainConfig)}
    if getattr(args, "config", None):
        given = getattr(args, "explicit", set())
        values.update({name: value for name, value in read_config(args.config).items() if name not in given})
    if (
        values["data"] is None
    ):  # not given: TrainConfig's own default (`ssp train` itself refuses that, see `check_data`)
        del values["data"]
    return TrainConfig(**values)


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
            "--data is required: a data set folder (`ssp ingest`, `ssp synth`) or a MovieLens folder; `ssp demo` runs on the "
            "bundled ml-latest-small"
        )
    fs, inner = storage.filesystem(data)
    if fs.isfile(inner):
        raise UserError(
            f"--data {data} is a file: training reads a data set folder; turn an interaction log into one with `ssp ingest "
            f"--interactions {data} --catalog ITEMS --features ... --out FOLDER`"
        )


def main(args: argparse.Namespace) -> int:
    if args.plan:  # the settings and the public catalog's size only: --data may be left out
        from pipelines.data.datasets import is_dataset, open_dataset
        from pipelines.training import plan

        data = args.data
        catalog = open_dataset(data).manifest.get("items") if data and is_dataset(data) else None
        print(plan.describe(config_from_args(args), catalog))
        return 0
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
    print(describe(run(config)))
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
        metrics = evaluate(Run(args.run))
    print(describe(metrics))
    return 0
