"""SSP1 vs SSP2: the cells at fixed privacy, their grid, report and plot from hand-made cells."""

import matplotlib.pyplot as plt

from bench import harness, resampling
from tests.bench.handmade import DATA, forbid_training, value

SIZE = {
    "epsilons": [1.0, 10.0],
    "resamples": [1, 4, 16],
    "config": {"outer_steps": 1, "epochs": 16, "item_id_feature": False},
}


def test_cells_vary_only_the_resamples_and_the_seed():
    cells = resampling.cell_list(DATA, "rmse", SIZE, 2)
    assert len(cells) == 2 * 3 * 2
    assert {c["method"] for c in cells} == {"ssp"} and {c["config"]["epochs"] for c in cells} == {16}
    assert [(c["epsilon"], c["config"]["resamples"]) for c in cells[:6]] == [
        (1.0, 1),
        (1.0, 1),
        (1.0, 4),
        (1.0, 4),
        (1.0, 16),
        (1.0, 16),
    ]
    assert all(c["config"]["item_id_feature"] is False and c["config"]["encoder"] == "features" for c in cells)


def test_report_and_plot_from_handmade_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(resampling, "sizes", lambda quick: SIZE)
    forbid_training(monkeypatch)
    # test RMSE = 1 + R/100 at epsilon 1, flat at epsilon 10; seeds differ by 0.01
    results = harness.Results(str(tmp_path))
    for params in resampling.cell_list(DATA, "rmse", SIZE, 2):
        r, seed = params["config"]["resamples"], params["seed"] - 100
        results.put("resampling", params, value((1 + r / 100 if params["epsilon"] == 1.0 else 0.9) + 0.01 * seed))
    harness.run_experiment("resampling", str(tmp_path), seeds=2, progress=False, data=DATA)
    report = (tmp_path / "report.md").read_text()
    assert "| 1 | 1.0150 ± 0.0071 | 1.0450 ± 0.0071 | 1.1650 ± 0.0071 |" in report
    assert "at epsilon = 1, going from R = 1 to R = 16 changes test RMSE by +0.1500 (worse)" in report
    assert "at epsilon = 10, going from R = 1 to R = 16 changes test RMSE by +0.0000 (not worse)" in report
    assert plt.imread(str(tmp_path / "resampling_rmse.png")).ndim == 3

    grid = resampling.grid([results.get("resampling", p) for p in resampling.cell_list(DATA, "rmse", SIZE, 2)], SIZE, 2)
    assert grid.shape == (2, 2, 3) and grid[0, 1, 2] == 1.17 and grid[1, 0, 0] == 0.9
    fig = resampling.plot(SIZE, grid, "rmse")
    (ax,) = fig.axes
    assert (
        ax.get_xlabel() == "noise resamples R over 16 epochs (releases)"
        and ax.get_ylabel() == "test RMSE (rating stars)"
    )
    assert len(ax.get_legend().get_texts()) == 2
    plt.close(fig)


def test_not_run_without_ssp(tmp_path, monkeypatch):
    forbid_training(monkeypatch)
    harness.run_experiment("resampling", str(tmp_path), seeds=1, progress=False, data=DATA, methods=["als"])
    assert "Not run: AM-SSP (`ssp`) is not among the selected methods." in (tmp_path / "report.md").read_text()
