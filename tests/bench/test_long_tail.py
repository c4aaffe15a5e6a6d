"""Long tail: per-bucket metrics from the shared privacy-utility cells, best per bucket, plot panels."""

import math

import matplotlib.pyplot as plt
import numpy as np

from bench import harness, long_tail, privacy_utility
from tests.bench.handmade import DATA, SIZE, fill_privacy_utility, forbid_training, value

# DP-ALS better on the head, AM-SSP better on the tail; bucket 4 has no test rows for the top line
ALS = [1.3, 1.1, 1.0, 0.9, 0.80]
SSP = [1.1, 1.0, 1.0, 0.95, 0.90]


def cells(sliced, shift=0.0):
    return [value(1.0, sliced=[x + shift for x in sliced]), value(1.0, sliced=[x - shift for x in sliced])]


def test_section_from_the_privacy_utility_cells(tmp_path, monkeypatch):
    monkeypatch.setattr(privacy_utility, "sizes", lambda quick: SIZE)
    forbid_training(monkeypatch)
    fill_privacy_utility(
        str(tmp_path),
        "rmse",
        {
            ("nonprivate-als", None): [value(0.8, spent=None, sliced=[0.9, 0.85, 0.8, 0.75, None])] * 2,
            ("als", 1.0): cells(ALS, 0.01),
            ("als", 10.0): cells(ALS),
            ("ssp", 1.0): cells(SSP),
            ("ssp", 10.0): cells(SSP),
        },
    )
    harness.run_experiment(
        "long-tail", str(tmp_path), seeds=2, progress=False, data=DATA, methods=["nonprivate-als", "als", "ssp"]
    )
    report = (tmp_path / "report.md").read_text()
    assert "| DP-ALS | 1 | 1.3000 ± 0.0141 | 1.1000 ± 0.0141 |" in report
    assert (
        "| non-private ALS (id) | non-private | 0.9000 ± 0.0000 | 0.8500 ± 0.0000 | 0.8000 ± 0.0000 | 0.7500 ± 0.0000 "
        "| - |" in report
    )
    assert (
        "epsilon = 1: best on the rarest fifth: AM-SSP (1.1000), on the most popular fifth: DP-ALS (0.8000)." in report
    )
    assert plt.imread(str(tmp_path / "long_tail_rmse.png")).ndim == 3


def test_plot_has_one_labelled_panel_per_epsilon():
    collected = {
        "size": SIZE,
        "groups": {
            ("nonprivate-als", None): {"tests": [value(0.8, sliced=[0.9, 0.85, 0.8, 0.75, None])]},
            ("als", 1.0): {"tests": cells(ALS)},
            ("als", 10.0): {"tests": cells(ALS)},
        },
    }
    assert np.isnan(long_tail.sliced(collected["groups"][("nonprivate-als", None)])[0, 4])
    fig = long_tail.plot(collected, "recall")
    assert [ax.get_title() for ax in fig.axes] == ["epsilon = 1", "epsilon = 10"]
    for ax in fig.axes:
        assert (
            ax.get_xlabel() == "item popularity bucket, 0 = rarest fifth (bucket)"
            and ax.get_ylabel() == "test Recall@20 (fraction of targets)"
        )
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [
            "non-private ALS (id) (mean)",
            "DP-ALS (mean ± std, 2 seeds)",
        ]
        np.testing.assert_allclose(ax.lines[0].get_ydata(), [0.9, 0.85, 0.8, 0.75, math.nan])  # no test rows: a gap
    plt.close(fig)
