"""Harness: resumable cells, report assembly with figures, labelled plots, mean +- std bands."""

import json
import os

import matplotlib.image
import matplotlib.pyplot as plt
import numpy as np
import pytest

from bench import harness

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_a_finished_cell_is_not_recomputed(tmp_path):
    calls = []

    def compute(params):
        calls.append(params["x"])
        return {"square": params["x"] ** 2}

    first = harness.Results(str(tmp_path)).run("toy", [{"x": 1}, {"x": 2}], compute, progress=False)
    again = harness.Results(str(tmp_path)).run("toy", [{"x": 1}, {"x": 2}, {"x": 3}], compute, progress=False)
    assert calls == [1, 2, 3]
    assert first == [{"square": 1}, {"square": 4}]
    assert again == [{"square": 1}, {"square": 4}, {"square": 9}]
    # the same parameters under another experiment are another cell
    harness.Results(str(tmp_path)).run("other", [{"x": 1}], compute, progress=False)
    assert calls == [1, 2, 3, 1]


def test_an_interrupted_run_keeps_its_finished_cells(tmp_path):
    path = tmp_path / "results.json"
    calls = []

    def compute(params):
        calls.append(params["x"])
        if params["x"] == 1:  # the first cell is on disk before the second starts
            assert json.loads(path.read_text())["cells"]['toy|{"x": 0}']["value"] == {"x": 0}
        if params["x"] == 2 and len(calls) == 3:
            raise KeyboardInterrupt
        return {"x": params["x"]}

    cells = [{"x": 0}, {"x": 1}, {"x": 2}]
    with pytest.raises(KeyboardInterrupt):
        harness.Results(str(tmp_path)).run("toy", cells, compute, progress=False)
    assert harness.Results(str(tmp_path)).run("toy", cells, compute, progress=False) == [{"x": 0}, {"x": 1}, {"x": 2}]
    assert calls == [0, 1, 2, 2]


def _toy_experiment(name, counter):
    def run(ctx):
        counter.append(name)
        value = ctx.results.run(
            name, [{"seed": s} for s in range(ctx.seeds)], lambda p: {"y": p["seed"] + 1.0}, ctx.progress
        )
        fig, (ax,) = harness.new_figure()
        harness.mean_std_band(ax, [0, 1], [[v["y"], 2 * v["y"]] for v in value], "toy")
        harness.finish(ax, f"{name} title", "x axis (s)", "y axis (m)")
        section = harness.Section(f"{name} section")
        section.text(f"{name} text")
        section.table(["a", "b"], [[1, 0.5]])
        section.figure(harness.save_figure(fig, ctx.out, f"{name}.png"), f"{name} caption")
        return section

    return harness.Experiment(name, "toy", run)


def test_report_holds_every_section_and_figure_in_registered_order(tmp_path, monkeypatch):
    counter = []
    monkeypatch.setattr(
        harness,
        "EXPERIMENTS",
        {"first": _toy_experiment("first", counter), "second": _toy_experiment("second", counter)},
    )
    out = str(tmp_path)
    harness.run_experiment("second", out, seeds=2, progress=False)
    harness.run_experiment("first", out, seeds=2, progress=False)
    report = (tmp_path / "report.md").read_text()
    assert report.index("## first section") < report.index("## second section")
    for name in ("first", "second"):
        assert f"![{name} caption]({name}.png)" in report
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
        assert matplotlib.image.imread(str(tmp_path / f"{name}.png")).ndim == 3
    assert "| a | b |\n| --- | --- |\n| 1 | 0.5 |" in report
    # rerunning a section replaces it rather than appending a copy
    harness.run_experiment("first", out, seeds=2, progress=False)
    assert (tmp_path / "report.md").read_text().count("## first section") == 1
    assert sorted(os.listdir(tmp_path / "sections")) == ["first.md", "second.md"]


def test_finish_sets_title_labels_and_legend():
    fig, (ax,) = harness.new_figure()
    ax.plot([0, 1], [0, 1], label="line")
    harness.finish(ax, "T", "time (s)", "distance (m)")
    assert (ax.get_title(), ax.get_xlabel(), ax.get_ylabel()) == ("T", "time (s)", "distance (m)")
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["line"]
    plt.close(fig)


@pytest.mark.parametrize(
    "xlabel, ylabel, label",
    [("time", "distance (m)", "line"), ("time (s)", "distance", "line"), ("time (s)", "distance (m)", None)],
)
def test_finish_refuses_unitless_labels_and_missing_legend(xlabel, ylabel, label):
    fig, (ax,) = harness.new_figure()
    ax.plot([0, 1], [0, 1], label=label)
    with pytest.raises(ValueError):
        harness.finish(ax, "T", xlabel, ylabel)
    plt.close(fig)


def test_mean_std_band_draws_the_mean_and_one_std_either_side():
    fig, (ax,) = harness.new_figure()
    harness.mean_std_band(ax, [0.0, 1.0], [[1.0, 2.0], [3.0, 6.0]], "curve")
    # mean (2, 4); sample std (sqrt 2, 2 sqrt 2)
    np.testing.assert_allclose(ax.lines[0].get_ydata(), [2.0, 4.0])
    assert ax.lines[0].get_label() == "curve (mean ± std, 2 seeds)"
    ys = ax.collections[0].get_paths()[0].vertices[:, 1]
    np.testing.assert_allclose([ys.min(), ys.max()], [2 - np.sqrt(2), 4 + 2 * np.sqrt(2)])
    plt.close(fig)
