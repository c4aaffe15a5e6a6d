"""`python -m pipelines.beam_stats FLAGS [Beam pipeline options]`: the stats job as a Beam pipeline
(the flags of `ssp stats`; any runner, DirectRunner by default). A thin script: the pipeline is
pipelines.engines.beam_release.

Privacy: that of pipelines.releases.stats_job (every release goes through the run's ledger).
"""

from __future__ import annotations

import argparse
import sys

from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.engines.prepare_beam import BeamEngine
from pipelines.releases import stats_job
from pipelines.training.stats_stage import stats_job_of_run


def _unknown_to_beam(beam_args: list[str]) -> list[str]:
    """Flags that no Beam pipeline option (nor this job) knows: likely typos, ignored by Beam."""
    options = PipelineOptions(beam_args)
    known = set(options.get_all_options())
    return sorted(set(options.get_all_options(retain_unknown_options=True)) - known)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.beam_stats",
        description="The AM-SSP stats job on Apache Beam: noised A_j, b_j for every catalog item.",
        epilog="Every other flag is a Beam pipeline option, passed through (e.g. --runner DirectRunner, the default; "
        "--direct_num_workers 2 --direct_running_mode multi_processing; --runner DataflowRunner --project P --region R "
        "--temp_location gs://...). Flags that neither this job nor Beam knows are refused.",
    )
    stats_job.add_arguments(parser)
    args, beam_args = parser.parse_known_args(argv)
    unknown = _unknown_to_beam(beam_args)
    if unknown:  # refused before anything is spent: a mistyped stats flag must not make a release
        parser.error(
            "unrecognized arguments (neither stats flags nor Beam pipeline options): "
            f"{' '.join('--' + name for name in unknown)}"
        )

    def compute() -> dict | None:
        job = stats_job.StatsJob.from_args(args, stats_job_of_run)
        return (
            None if job is None else BeamEngine(PipelineOptions(beam_args)).release_stats(job)
        )  # None: a run's step with nothing to release

    return stats_job.run_and_report(compute)


if __name__ == "__main__":
    sys.exit(main())
