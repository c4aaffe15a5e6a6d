"""A run's user-update stage and the `ssp user-update` command (also `spark-submit
pipelines/user_update.py`).

Two modes: explicit tables (`--interactions --item-embeddings --out`), or a stage of a training
run (`--run RUN --step s`: step s's users against step s-1's item embeddings; `--run RUN --final`:
against the last step's, for evaluation), where inputs, output and settings come from the run's
manifest (pipelines.training.run_dir). The solve itself is pipelines.engines.user_solves.

Privacy: reads private interactions and released item embeddings; the user embeddings it writes
are private (they stay in the run directory and only ever enter the stats job, which clips them).
"""

from __future__ import annotations

import argparse

from pipelines.engines.engine import Engine, add_engine_argument, engine_of
from pipelines.engines.user_solves import DEFAULT_LAMBDA_U, UserSolve
from pipelines.training.run_dir import Run, config_of, existing_run_lock, require_steps
from schemas.errors import UserError
from trainer.solve import user_bias_ridge


def run_step(engine: Engine, root: str, step: int | None) -> int:
    """The user update of outer step `step` of the run at `root` (against step s-1's item
    embeddings), or the final one (`step` None: against the last step's), on `engine`; returns the user count.
    The solves' task seconds go into the manifest's `kernel_seconds`."""
    layout = Run(root)
    manifest = layout.prepared()
    config = config_of(layout, manifest)
    steps = config.outer_steps
    if step is not None and not (isinstance(step, int) and 1 <= step <= steps):
        raise UserError(f"--step must be an outer step of the run, 1..{steps}, got {step}")
    require_steps(layout, manifest, steps + 1 if step is None else step)
    source = layout.item_embeddings(steps if step is None else step - 1)
    solve = UserSolve(
        config.lambda_u,
        config.vector_dim,
        config.gravity,
        config.loss,
        user_bias_ridge(config.protocol, config.biases, config.lambda_bias),
        constant=config.item_update == "item-mean",
        prior=config.user_prior,
        confidence=config.settings().confidence,
    )
    solved = engine.user_update(layout.centred, source, layout.user_embeddings(step), solve)
    layout.record_seconds(
        "final_user_update" if step is None else f"step-{step}/user_update", solved.solve_seconds, "kernel_seconds"
    )
    return solved.users


def add_arguments(parser: argparse.ArgumentParser) -> None:
    stage = parser.add_argument_group("a stage of a training run (inputs and settings from RUN/manifest.json)")
    stage.add_argument("--run", help="run directory prepared by `ssp train --stage prepare`")
    stage.add_argument(
        "--step", type=int, help="with --run: outer step s (its users against step s-1's item embeddings)"
    )
    stage.add_argument(
        "--final",
        action="store_true",
        help="with --run: the final user update (against the last step's item embeddings), for evaluation",
    )
    tables = parser.add_argument_group("explicit tables")
    tables.add_argument("--interactions", help="interactions table (private)")
    tables.add_argument("--item-embeddings", help="item embeddings table (a release or public initialisation)")
    tables.add_argument("--out", help="user embeddings table to write (private)")
    tables.add_argument(
        "--lambda-u",
        type=float,
        help="ridge of the user solve, lambda_u n I for a user with n ratings (trusted side: no privacy effect; "
        f"default: {DEFAULT_LAMBDA_U})",
    )
    tables.add_argument("--dim", type=int, help="expected embedding dimension (checked)")
    add_engine_argument(parser)
    parser.add_argument(
        "--master",
        help="Spark master URL for a job run outside spark-submit (default: local[*], every core of this machine, "
        "unless spark-submit sets one)",
    )


def main(args: argparse.Namespace) -> int:
    explicit = {
        "--interactions": args.interactions,
        "--item-embeddings": args.item_embeddings,
        "--out": args.out,
        "--lambda-u": args.lambda_u,
        "--dim": args.dim,
    }
    if args.run is not None:
        given = [flag for flag, value in explicit.items() if value is not None]
        if given:
            raise UserError(f"--run takes the inputs and settings from the run's manifest; drop {', '.join(given)}")
        if (args.step is None) == (not args.final):
            raise UserError("with --run give exactly one of --step S and --final")
        Run(args.run).prepared()  # a missing or damaged run is refused before a JVM starts
        scratch = Run(args.run).private("beam")
        with (
            existing_run_lock(args.run),
            engine_of(args.engine, app="ssp-user-update", master=args.master, scratch=scratch) as engine,
        ):
            run_step(engine, args.run, None if args.final else args.step)
        print(f"wrote the user embeddings of {args.run} ({'final' if args.final else f'step {args.step}'}; private)")
        return 0
    if args.step is not None or args.final:
        raise UserError("--step and --final belong to --run RUN")
    missing = [flag for flag in ("--interactions", "--item-embeddings", "--out") if explicit[flag] is None]
    if missing:
        raise UserError(f"give --run RUN with --step S or --final, or the tables: missing {', '.join(missing)}")
    lambda_u = DEFAULT_LAMBDA_U if args.lambda_u is None else args.lambda_u
    with engine_of(args.engine, app="ssp-user-update", master=args.master) as engine:
        engine.user_update(args.interactions, args.item_embeddings, args.out, UserSolve(lambda_u, args.dim))
    print(f"wrote the user embeddings to {args.out} (private)")
    return 0
