"""RUN/report.html as a person opens it: a real headless Chromium renders the page of a real run
(its DOM after loading, and a screenshot whose pixels show the plots), with the run's metrics, its
ledger's releases, the catalog's titles beside the example recommendations and the plain-words
guarantee; `ssp publish` leaves it in the run."""

import json
import os
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image

from pipelines.training import run_report
from privacy.ledger import Ledger
from schemas import storage
from ssp import cli

BROWSERS = ("chromium", "chromium-browser")


def browser() -> str:
    found = next((path for path in map(shutil.which, BROWSERS) if path), None)
    if found is None:
        pytest.fail("no headless Chromium on PATH: `./setup.sh --tests` installs Debian's chromium (as root)")
    return found


def chromium(page: str, *flags: str) -> subprocess.CompletedProcess:
    command = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *flags, f"file://{page}"]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("report-data") / "data"
    argv = ["synth", "--users", "300", "--items", "80", "--ratings-per-user", "15", "--out", str(folder), "-q"]
    assert cli.main(argv) == 0
    return folder


@pytest.mark.parametrize(
    "protocol, flags", [("recall", ["--epsilon", "5"]), ("rmse", ["--non-private", "--outer-steps", "2"])]
)
def test_the_report_opens_in_headless_chromium_with_its_plots_titles_and_releases(data, tmp_path, protocol, flags):
    run = tmp_path / "run"
    argv = ["train", "--data", str(data), "--out", str(run), "--engine", "local", "--protocol", protocol, "-q", *flags]
    assert cli.main(argv) == 0
    page, metrics = str(run / "report.html"), json.loads((run / "metrics.json").read_text())
    dom = chromium(page, "--dump-dom").stdout
    assert dom.count("<svg") == 1 + (not metrics["non_private"])  # quality by fifth; the budget when there is one
    sliced = metrics["test_recall_at_20_sliced" if protocol == "recall" else "test_rmse_sliced"]
    assert dom.count("<title>model, ") == sum(value is not None for value in sliced)
    headline = ("test_recall_at_20", "test_popularity_recall_at_20") if protocol == "recall" else ("test_rmse", None)
    assert f"{metrics[headline[0]]:.4f}" in dom
    if metrics["non_private"]:
        assert "No privacy: this run used every interaction exactly" in dom
    else:
        above = metrics[headline[0]] > metrics[headline[1]]
        assert (f"The model is {'above' if above else 'BELOW'} DP popularity") in dom
        ledger = Ledger.open(str(run / "ledger.parquet"))
        assert [f"<code>{row['name']}</code>" in dom for row in ledger.rows] == [True] * len(ledger.rows)
        assert f"e^{ledger.epsilon_spent():.3g}" in dom and "except with a chance of at most 1e-05" in dom
    titles = storage.read_table(str(data / "items.parquet"), columns=["item_id", "title"]).to_pydict()
    title_of = dict(zip(titles["item_id"], titles["title"], strict=True))
    shown = [title_of[item] for item in title_of if f"{title_of[item]} <small>({item})</small>" in dom]
    assert len(shown) >= 10  # every example's top 10 and history by their titles
    # the plots are drawn: the model's and its baseline's colours are on the screen
    chromium(page, f"--screenshot={tmp_path / 'page.png'}", "--window-size=1000,1600")
    pixels = np.asarray(Image.open(tmp_path / "page.png").convert("RGB")).reshape(-1, 3)
    for colour in (run_report.MODEL, run_report.BASELINE):
        rgb = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
        assert (pixels == rgb).all(axis=1).sum() > 500, colour
    if not metrics["non_private"]:  # published, the run leaves the page behind: it holds held-out users' data
        assert cli.main(["publish", "--run", str(run), "--to", str(tmp_path / "published")]) == 0
        assert "privacy.md" in os.listdir(tmp_path / "published") and "report.html" not in os.listdir(
            tmp_path / "published"
        )
