"""What a run keeps private stays its owner's on disk, whatever the umask, through the installed `ssp`:
the run's private folder, the data set, the seed and the budget-account registry are 0700 / 0600,
and a seed or registry that others can read is refused, as ssh refuses a readable private key."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

from privacy.lifetime_budget import accounts_home
from tests.test_hostile_cli import SSP, assert_refused, child_env, movielens_copy


def ssp_with_umask(*args, umask: int = 0o022) -> subprocess.CompletedProcess:
    """The installed `ssp` under `umask` (0o022: the common one, new files readable by everyone)."""
    return subprocess.run(
        [SSP, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(),
        preexec_fn=lambda: os.umask(umask),
    )


def readable_by_others(root: Path) -> list[str]:
    paths = [root, *root.rglob("*")]
    return [f"{p} {stat.S_IMODE(p.stat().st_mode):04o}" for p in paths if stat.S_IMODE(p.stat().st_mode) & 0o077]


def test_a_runs_private_files_the_data_set_and_the_registry_are_the_owners_alone(tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    source = movielens_copy(tmp_path / "source", ratings_rows=20_000)  # a fifth of the bundled ratings: a quicker run
    assert ssp_with_umask("ingest", "--source", source, "--out", data, "--data-source", "movielens").returncode == 0
    result = ssp_with_umask(
        "train",
        "--data",
        data,
        "--out",
        run,
        "--engine",
        "local",
        "--epsilon",
        5,
        "--dim",
        4,
        "--epochs",
        2,
        "--outer-steps",
        1,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    registry = Path(accounts_home())
    assert (run / "private" / "seed").exists() and list(registry.glob("*.json"))
    for private in (run / "private", data, registry):
        assert readable_by_others(private) == [], private
    assert stat.S_IMODE((run / "ledger.parquet").stat().st_mode) & 0o044  # public outputs stay readable

    (run / "private" / "seed").chmod(0o644)  # a seed others can read: refused, as ssh refuses a readable key
    again = ssp_with_umask("privacy", run)
    assert_refused(again, "seed: the secret noise seed", "can be read by others (mode 0644)", "chmod 600")
    (run / "private" / "seed").chmod(0o600)

    registry.chmod(0o755)
    refused = ssp_with_umask("train", "--data", data, "--out", tmp_path / "other", "--engine", "local")
    assert_refused(refused, "the budget-account registry can be read by others (mode 0755)", "chmod 700")
    assert not (tmp_path / "other").exists()
