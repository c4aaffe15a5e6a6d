"""The experiment harness: resumable result cells, report sections, labelled plots.

An experiment is a function registered under a name with `@experiment(name, help)`; it receives a
`Context` and returns a `Section`. Its numbers are computed in cells: each cell is keyed by
(experiment, parameters), stored in OUT/results.json (rewritten atomically after every cell), and
never recomputed once finished, so an interrupted run resumes where it stopped. Its section (text,
tables, figures) is kept in OUT/sections/<name>.md, and OUT/report.md is reassembled from every
section present, in registration order, so experiments run by separate commands share one report.

OUT is a local folder (the report links its PNGs by relative path).

Plots go through `new_figure` / `finish` / `save_figure`: `finish` refuses an axis without a title,
axis labels that name their unit in parentheses, or a legend, because a figure in the report must
be readable on its own.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import matplotlib

from schemas.errors import UserError

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from schemas import storage  # noqa: E402
from schemas.progress import bar as progress_bar  # noqa: E402

RESULTS = "results.json"
REPORT = "report.md"
SECTIONS = "sections"
_UNIT = re.compile(r"\(.+\)\s*$")


class Results:
    """The cells of OUT/results.json: {key: {"experiment", "params", "value"}}."""

    def __init__(self, out: str):
        self.path = os.path.join(out, RESULTS)
        self.cells: dict[str, dict] = storage.read_json(self.path)["cells"] if os.path.exists(self.path) else {}

    @staticmethod
    def key(experiment: str, params: dict) -> str:
        return f"{experiment}|{json.dumps(params, sort_keys=True)}"

    def get(self, experiment: str, params: dict) -> dict | None:
        cell = self.cells.get(self.key(experiment, params))
        return None if cell is None else cell["value"]

    def put(self, experiment: str, params: dict, value: dict) -> None:
        self.cells[self.key(experiment, params)] = {"experiment": experiment, "params": params, "value": value}
        storage.write_json({"cells": self.cells}, self.path)

    def run(
        self,
        experiment: str,
        cells: list[dict],
        compute: Callable[[dict], dict],
        progress: bool = True,
        desc: str | None = None,
    ) -> list[dict]:
        """The value of every cell (parameters), computing (with a progress bar, `desc` or the
        experiment's name) only the missing ones."""
        values = []
        with progress_bar(cells, desc=desc or experiment, unit="cell", enabled=progress) as bar:
            for params in bar:
                value = self.get(experiment, params)
                if value is None:
                    value = compute(params)
                    self.put(experiment, params, value)
                values.append(value)
        return values


@dataclass
class Section:
    """One experiment's part of the report: Markdown blocks in order."""

    title: str
    blocks: list[str] = field(default_factory=list)

    def text(self, paragraph: str) -> None:
        self.blocks.append(paragraph.strip())

    def table(self, headers: list[str], rows: list[list]) -> None:
        def cell(value) -> str:
            return f"{value:.4g}" if isinstance(value, float) else str(value)

        lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self.blocks.append("\n".join(lines))

    def figure(self, name: str, caption: str) -> None:
        """Embed OUT/<name> (written by `save_figure`)."""
        self.blocks.append(f"![{caption}]({name})\n\n*{caption}*")

    def markdown(self) -> str:
        return f"## {self.title}\n\n" + "\n\n".join(self.blocks) + "\n"


@dataclass
class Context:
    """What an experiment gets: where to write, how big to run, its result cells, and what to run on
    (the training experiments' data set, protocol and methods; None: the bundled data, every method;
    the privacy-utility experiment's epsilons, None: its own, the data set it tunes on, None: the
    data set itself, and its trials per study, None: its own; 1: every method at its defaults)."""

    out: str
    quick: bool
    seeds: int
    results: Results
    progress: bool = True
    data: str | None = None
    protocol: str = "rmse"
    methods: list[str] | None = None
    epsilons: list[float] | None = None
    tune_on: str | None = None
    trials: int | None = None


@dataclass(frozen=True)
class Experiment:
    name: str
    help: str
    run: Callable[[Context], Section]


EXPERIMENTS: dict[str, Experiment] = {}


def experiment(name: str, help: str):
    """Register `fn(ctx) -> Section` as the experiment `name` (a `python -m bench` subcommand)."""

    def register(fn: Callable[[Context], Section]):
        if name in EXPERIMENTS:
            raise UserError(f"experiment {name!r} is registered twice")
        EXPERIMENTS[name] = Experiment(name, help, fn)
        return fn

    return register


def run_experiment(
    name: str, out: str, quick: bool = False, seeds: int = 3, progress: bool = True, **options
) -> Section:
    """Run a registered experiment into OUT: its cells, its section, then the whole report.
    `options`: Context's data, protocol, methods, epsilons, tune_on and trials."""
    os.makedirs(out, exist_ok=True)
    section = EXPERIMENTS[name].run(Context(out, quick, seeds, Results(out), progress, **options))
    _write_text(os.path.join(out, SECTIONS, f"{name}.md"), section.markdown())
    write_report(out)
    return section


def write_report(out: str) -> str:
    """Assemble OUT/report.md from the sections present (registered order first); returns its path."""
    folder = os.path.join(out, SECTIONS)
    present = (
        sorted(f.removesuffix(".md") for f in os.listdir(folder) if f.endswith(".md")) if os.path.isdir(folder) else []
    )
    order = [n for n in EXPERIMENTS if n in present] + [n for n in present if n not in EXPERIMENTS]
    parts = [
        "# Reproduction of the paper's experiments\n",
        "Numbers come from `results.json` next to this file; figures are the PNGs beside it.\n",
    ]
    parts += [open(os.path.join(folder, f"{n}.md"), encoding="utf-8").read() for n in order]
    path = os.path.join(out, REPORT)
    _write_text(path, "\n".join(parts))
    return path


def _write_text(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
    os.replace(tmp, path)


def new_figure(ncols: int = 1, width: float = 5.5, height: float = 4.0):
    """(figure, list of axes) side by side."""
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def finish(ax, title: str, xlabel: str, ylabel: str, legend_loc: str = "best") -> None:
    """Title, unit-bearing axis labels ("batch size (examples)") and a legend, or an error."""
    for label in (xlabel, ylabel):
        if not _UNIT.search(label):
            raise UserError(f"axis label {label!r} must end with its unit in parentheses")
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if not ax.get_legend_handles_labels()[1]:
        raise UserError(f"plot {title!r} has no labelled series for a legend")
    ax.legend(loc=legend_loc, fontsize="small")
    ax.grid(True, which="both", alpha=0.3)


def save_figure(fig, out: str, name: str) -> str:
    """Write the figure to OUT/<name> (PNG) and close it; returns `name` for `Section.figure`."""
    fig.tight_layout()
    fig.savefig(os.path.join(out, name), dpi=110, format="png")
    plt.close(fig)
    return name


def mean_std_band(ax, x, ys, label: str, **style) -> None:
    """Plot the mean over seeds (rows of `ys`) with a shaded mean +- std band."""
    ys = np.asarray(ys, dtype=float)
    mean = ys.mean(axis=0)
    std = ys.std(axis=0, ddof=1) if ys.shape[0] > 1 else np.zeros_like(mean)
    (line,) = ax.plot(x, mean, marker="o", label=f"{label} (mean ± std, {ys.shape[0]} seeds)", **style)
    ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
