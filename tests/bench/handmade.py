"""Hand-made result cells for the training experiments: the cells they would compute, with chosen
values, written to OUT/results.json so that an experiment's report can be checked without training."""

from bench import harness, privacy_utility, training

DATA = "/data/ml-fake"

SIZE = {"epsilons": [1.0, 10.0], "trials": 2, "base": {"epochs": 2}, "caps": {}}


def value(test: float, spent: float | None = 1.0, sliced=None, times=(1.0, 2.0), steps=None) -> dict:
    """A cell value as training.run_cell records it (valid = test; trajectory `steps` at `times`)."""
    steps = steps or [test] * len(times)
    return {
        "valid": test,
        "test": test,
        "test_sliced": sliced or [test] * training.BUCKETS,
        "epsilon_spent": spent,
        "seconds": times[-1],
        "trajectory": [
            {"step": s, "seconds": t, "valid": v, "test": v} for s, (t, v) in enumerate(zip(times, steps, strict=True))
        ],
    }


def fill_privacy_utility(
    out: str,
    protocol: str,
    tests: dict,
    size: dict = SIZE,
    valids: dict | None = None,
    data: str = DATA,
    test_data: str | None = None,
) -> dict:
    """Record the privacy-utility cells of `tests` {(method, epsilon): [test metric or cell value per
    seed]}: the study's trials on `data` (through privacy_utility.study, as the experiment runs
    them), scored `valids` {(method, epsilon): [valid per trial]} (default: the last trial best),
    then the chosen config's test cells on `test_data` (default: `data`). Returns {(method,
    epsilon): chosen config}."""
    results = harness.Results(out)
    metric = training.METRICS[protocol]
    chosen = {}
    for (name, eps), per_seed in tests.items():
        scores = (valids or {}).get((name, eps)) or [
            1.0 - 0.1 * k if metric.lower_is_better else 0.1 * k for k in range(size["trials"])
        ]
        trials = privacy_utility.study(
            results,
            data,
            protocol,
            name,
            eps,
            size=size,
            compute=lambda p, scores=scores, eps=eps: value(scores[p["seed"]], spent=eps),
        )
        chosen[(name, eps)] = trials[privacy_utility.best_trial([t["value"] for t in trials], protocol)]["params"][
            "config"
        ]
        for params, cell in zip(
            privacy_utility.test_params(test_data or data, protocol, name, eps, chosen[(name, eps)], len(per_seed)),
            per_seed,
            strict=True,
        ):
            results.put(privacy_utility.NAME, params, cell if isinstance(cell, dict) else value(cell, spent=eps))
    return chosen


def forbid_training(monkeypatch):
    """Make computing any cell an error: these tests must find every cell recorded."""

    def refuse(out, params):
        raise AssertionError(f"a cell was computed: {params}")

    monkeypatch.setattr(training, "run_cell", refuse)
