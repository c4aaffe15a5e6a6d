"""`spark-submit pipelines/user_update.py FLAGS`: the user update as a Spark application, the same
command as `ssp user-update FLAGS` (one-line errors, exit status 2 on bad input). A thin script:
the command is pipelines.training.user_stage, its solve pipelines.engines.user_solves. Run it from
the repository root, or from anywhere with the project's zip in `--py-files` (`ssp spark-package`).

Privacy: that of pipelines.training.user_stage (private inputs, private output, no release).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script by spark-submit: make the project importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse  # noqa: E402

from pipelines.base import command, logs  # noqa: E402
from pipelines.training import user_stage  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="user_update.py",
        description="The user update of a training run, or of explicit tables, on Spark (as `ssp user-update`).",
    )
    user_stage.add_arguments(parser)
    command.add_verbosity(parser)
    args = parser.parse_args(argv)
    logs.configure(args.verbosity)
    return command.run("user-update", lambda: user_stage.main(args), output=args.out or args.run)


if __name__ == "__main__":
    sys.exit(main())
