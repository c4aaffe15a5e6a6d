"""privacy.accounting's two expensive functions, memoized for the bench tests that run the product's
releases many times over the same few budget plans (bench cells, privacy audits).

`calibrate` and `epsilon_of` are pure functions of their arguments (the module's own guarantee: the
same canonical events compose to the same epsilon, to the last bit), so each distinct call is made
once per test process, by the product's own code, and every later identical call gets a copy of its
answer: every run still calibrates, records and checks its ledger exactly as it would, only without
recomputing a PLD calibration it has already made (a run makes the same one several times). What
these tests assert (cells shared and resumed, an audit's verdict) does not depend on that; the
accounting itself is tested, unmemoized, in tests/privacy."""

from __future__ import annotations

import json

from privacy import accounting

_calibrate, _epsilon_of = accounting.calibrate, accounting.epsilon_of
_CALIBRATED: dict = {}
_SPENT: dict = {}


def calibrate(epsilon, delta, plan, accountant=accounting.DEFAULT_ACCOUNTANT):
    key = (epsilon, delta, tuple(plan), accountant)
    if key not in _CALIBRATED:
        _CALIBRATED[key] = _calibrate(epsilon, delta, plan, accountant)
    return dict(_CALIBRATED[key])  # a copy: callers may change theirs (calibrate_dpsgd does)


def epsilon_of(events, delta, accountant=accounting.DEFAULT_ACCOUNTANT):
    key = (
        json.dumps([accounting.event_to_json(event) for event in accounting.canonical(events)], sort_keys=True),
        delta,
        accountant,
    )
    if key not in _SPENT:
        _SPENT[key] = _epsilon_of(events, delta, accountant)
    return _SPENT[key]


def install(monkeypatch) -> None:
    """Memoize privacy.accounting's calibrate and epsilon_of for one test (every caller looks them up
    on the module: the ledger, the releases, calibrate_dpsgd)."""
    monkeypatch.setattr(accounting, "calibrate", calibrate)
    monkeypatch.setattr(accounting, "epsilon_of", epsilon_of)
