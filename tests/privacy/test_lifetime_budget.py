"""privacy.lifetime_budget: a data source's lifetime budget, composed over every run's releases."""

from __future__ import annotations

import datetime
import json

import dp_accounting
import pytest
from dp_accounting.pld import pld_privacy_accountant

from privacy import accounting
from privacy import lifetime_budget as accounts
from privacy.ledger import Ledger
from privacy.lifetime_budget import AccountCapError, BudgetAccount
from schemas import storage

DELTA = 1e-5


def ledger_with_account(tmp_path, name, account, epsilon=5.0):
    return Ledger.create(str(tmp_path / name / "ledger.parquet"), epsilon, DELTA, accountant="pld", account=account)


def test_releases_of_every_run_compose_into_the_account(tmp_path):
    path = str(tmp_path / "account.json")
    BudgetAccount.open_or_create(path, cap=None, delta=DELTA, accountant="pld")
    events = {
        "a": [accounting.gaussian_event(6.0), accounting.gaussian_event(9.0, 2)],
        "b": [accounting.gaussian_event(7.5)],
    }
    for run, run_events in events.items():
        ledger = ledger_with_account(tmp_path, run, path)
        for k, event in enumerate(run_events):
            ledger.record(f"release-{k}", event, f"fp-{run}-{k}")
    reference = pld_privacy_accountant.PLDAccountant(value_discretization_interval=accounting.PLD_DISCRETIZATION)
    for event in events["a"] + events["b"]:
        reference.compose(event)
    account = BudgetAccount.open(path)
    assert len(account.document["charges"]) == 3
    assert account.epsilon() == pytest.approx(
        reference.get_epsilon(DELTA), rel=1e-5
    )  # PLD: the grid's order of composition
    # each run's own ledger spends less than the account: the account is what the users bear
    assert max(Ledger.open(str(tmp_path / r / "ledger.parquet")).epsilon_spent() for r in events) < account.epsilon()
    assert Ledger.open(str(tmp_path / "a" / "ledger.parquet")).check_account()["epsilon"] == pytest.approx(
        account.epsilon()
    )


def test_a_release_past_the_cap_is_refused_and_charges_nothing(tmp_path):
    path = str(tmp_path / "account.json")
    z = accounting.calibrate(1.0, DELTA, [accounting.Group("one", 1.0, 1)], "pld")[
        "one"
    ]  # one release spends epsilon 1
    BudgetAccount.open_or_create(path, cap=1.2, delta=DELTA, accountant="pld")
    first = ledger_with_account(tmp_path, "first", path)
    first.record("counts", accounting.gaussian_event(z), "fp1")
    second = ledger_with_account(tmp_path, "second", path)  # a fresh run on the same users: its own budget is untouched
    with pytest.raises(AccountCapError, match=r"lifetime epsilon .* over the cap 1.2") as info:
        second.record("counts", accounting.gaussian_event(z), "fp2")
    assert "nothing was released" in str(info.value)
    assert second.rows == [] and Ledger.open(second.path).rows == []
    assert len(BudgetAccount.open(path).document["charges"]) == 1
    # deleting the first run's ledger does not give the users a fresh budget
    (tmp_path / "first" / "ledger.parquet").unlink()
    with pytest.raises(AccountCapError):
        ledger_with_account(tmp_path, "third", path).record("counts", accounting.gaussian_event(z), "fp3")


def test_recharging_the_same_release_is_free(tmp_path):
    path = str(tmp_path / "account.json")
    account = BudgetAccount.open_or_create(path, cap=10.0, delta=DELTA)
    account.charge("L", 0, "counts", accounting.gaussian_event(3.0), fingerprint="fp")
    account.charge("L", 0, "counts", accounting.gaussian_event(3.0), fingerprint="fp")
    assert len(BudgetAccount.open(path).document["charges"]) == 1
    with pytest.raises(ValueError, match="charged with another event"):
        account.charge("L", 0, "counts", accounting.gaussian_event(4.0), fingerprint="fp")


def test_the_same_release_on_other_inputs_is_charged_again(tmp_path):
    """A copied run folder shares its ledger's id and release indices: release 0 made in the copy on
    inputs one user apart is a second release on these users, charged as one (and refused at the cap)."""
    path = str(tmp_path / "account.json")
    account = BudgetAccount.open_or_create(path, cap=None, delta=DELTA)
    account.charge("L", 0, "counts", accounting.gaussian_event(3.0), fingerprint="original")
    account.charge("L", 0, "counts", accounting.gaussian_event(3.0), fingerprint="original")  # a rerun: free
    account.charge("L", 0, "counts", accounting.gaussian_event(3.0), fingerprint="the copy's")
    assert [c["fingerprint"] for c in BudgetAccount.open(path).document["charges"]] == ["original", "the copy's"]
    twice = accounting.epsilon_of([accounting.gaussian_event(3.0)] * 2, DELTA, "pld")
    assert account.epsilon() == pytest.approx(twice)
    capped = BudgetAccount.open_or_create(str(tmp_path / "capped.json"), cap=twice * 0.9, delta=DELTA)
    capped.charge("L", 0, "counts", accounting.gaussian_event(3.0), fingerprint="original")
    with pytest.raises(AccountCapError, match="over the cap"):
        capped.charge("L", 0, "counts", accounting.gaussian_event(3.0), fingerprint="the copy's")


def test_window_lets_old_releases_drop_out(tmp_path, monkeypatch):
    path = str(tmp_path / "account.json")
    account = BudgetAccount.open_or_create(path, cap=None, delta=DELTA, window_days=7)
    then = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    monkeypatch.setattr(accounts, "_now", lambda: then)
    account.charge("L", 0, "old", accounting.gaussian_event(3.0), fingerprint="fp")
    monkeypatch.setattr(accounts, "_now", lambda: then + datetime.timedelta(days=10))
    account.charge("L", 1, "new", accounting.gaussian_event(3.0), fingerprint="fp")
    assert [c["name"] for c in account.counted()] == ["new"]
    assert account.epsilon() == pytest.approx(accounting.epsilon_of([accounting.gaussian_event(3.0)], DELTA, "pld"))


def test_an_account_keeps_its_policy(tmp_path):
    path = str(tmp_path / "account.json")
    BudgetAccount.open_or_create(path, cap=4.0, delta=DELTA)
    assert BudgetAccount.open_or_create(path).cap == 4.0  # later runs need not repeat it
    with pytest.raises(ValueError, match="has cap 4.0, not 8.0"):
        BudgetAccount.open_or_create(path, cap=8.0)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="cap must be > 0"):
            BudgetAccount.open_or_create(str(tmp_path / f"bad{bad}.json"), cap=bad)
    (tmp_path / "broken.json").write_text(json.dumps({"cap": 1}))
    with pytest.raises(ValueError, match="broken.json is not a budget account"):
        BudgetAccount.open(str(tmp_path / "broken.json"))


def test_check_account_refuses_a_ledger_the_account_does_not_list(tmp_path):
    path = str(tmp_path / "account.json")
    BudgetAccount.open_or_create(path, cap=None, delta=DELTA)
    ledger = ledger_with_account(tmp_path, "run", path)
    ledger.record("counts", dp_accounting.GaussianDpEvent(5.0), "fp")
    (tmp_path / "account.json").write_text(
        json.dumps({**json.loads((tmp_path / "account.json").read_text()), "charges": []})
    )
    with pytest.raises(ValueError, match=r"releases \[0\] are not charged to the budget account"):
        Ledger.open(ledger.path).check_account()


def test_runs_accounted_differently_compose_into_one_account_and_one_cap(tmp_path):
    """A central (PLD) run and a federated (RDP on integer orders) run on one data source: one
    account, each accountant's charges composed at half of delta, the two epsilons added."""
    path = str(tmp_path / "account.json")
    BudgetAccount.open_or_create(path, cap=4.0, delta=DELTA, accountant="pld")
    central = ledger_with_account(tmp_path, "central", path)
    federated = Ledger.create(
        str(tmp_path / "federated" / "ledger.parquet"), 5.0, DELTA, accountant="rdp-integer", account=path
    )
    central.record("counts", accounting.gaussian_event(3.0), "fp-c")
    federated.record("counts", accounting.gaussian_event(4.0), "fp-f")
    expected = accounting.epsilon_of([accounting.gaussian_event(3.0)], DELTA / 2, "pld") + accounting.epsilon_of(
        [accounting.gaussian_event(4.0)], DELTA / 2, "rdp-integer"
    )
    account = BudgetAccount.open(path)
    assert [c["accountant"] for c in account.document["charges"]] == ["pld", "rdp-integer"]
    assert account.epsilon() == pytest.approx(expected, rel=1e-9)
    assert account.epsilon() > accounting.epsilon_of(
        [accounting.gaussian_event(3.0), accounting.gaussian_event(4.0)], DELTA, "pld"
    )
    with pytest.raises(AccountCapError, match="over the cap 4"):  # the cap holds across both kinds of run
        federated.record("step-1/stats/r0", accounting.gaussian_event(1.5, 2), "fp-f1")
    assert len(BudgetAccount.open(path).document["charges"]) == 2


def test_a_release_without_noise_is_refused_on_a_capped_account(tmp_path):
    capped = str(tmp_path / "capped.json")
    BudgetAccount.open_or_create(capped, cap=100.0, delta=DELTA, accountant="pld")
    ledger = Ledger.create(str(tmp_path / "run" / "ledger.parquet"), float("inf"), DELTA, account=capped)
    with pytest.raises(AccountCapError, match="has no noise .* nothing was released"):
        ledger.record("counts", accounting.gaussian_event(0.0), "fp")
    assert Ledger.open(ledger.path).rows == [] and BudgetAccount.open(capped).document["charges"] == []
    uncapped = str(tmp_path / "uncapped.json")  # an account without a cap reports the infinite epsilon instead
    BudgetAccount.open_or_create(uncapped, cap=None, delta=DELTA, accountant="pld")
    Ledger.create(str(tmp_path / "run2" / "ledger.parquet"), float("inf"), DELTA, account=uncapped).record(
        "counts", accounting.gaussian_event(0.0), "fp"
    )
    assert BudgetAccount.open(uncapped).epsilon() == float("inf")


def test_a_named_source_composes_over_every_weeks_rows(tmp_path, monkeypatch):
    """The weekly retraining: each week's interactions have another content digest, and all are
    charged to the named source's one account; the same rows under a second name are refused."""
    monkeypatch.setenv(accounts.ACCOUNTS_ENV, str(tmp_path / "registry"))
    week1 = BudgetAccount.for_source("shop", cap=5.0, delta=DELTA, digest="d" * 64)
    week2 = BudgetAccount.for_source("shop", delta=DELTA, digest="e" * 64)
    assert week2.path == week1.path and week2.identity == week1.identity and week2.cap == 5.0
    with pytest.raises(ValueError, match="already accounted to data source 'shop'.*name them 'shop'"):
        BudgetAccount.for_source("shop-copy", delta=DELTA, digest="e" * 64)
    assert not (tmp_path / "registry" / "shop-copy.json").exists()
    unnamed = BudgetAccount.for_source("e" * 64, delta=DELTA, digest="e" * 64)  # the rows, given no name
    assert unnamed.identity == week1.identity


def test_rows_accounted_without_a_name_are_refused_under_one(tmp_path, monkeypatch):
    monkeypatch.setenv(accounts.ACCOUNTS_ENV, str(tmp_path / "registry"))
    BudgetAccount.for_source("f" * 64, delta=DELTA, digest="f" * 64)
    with pytest.raises(ValueError, match="a data source without a name"):
        BudgetAccount.for_source("shop", delta=DELTA, digest="f" * 64)


def test_a_source_declared_to_share_users_shares_the_account(tmp_path, monkeypatch):
    monkeypatch.setenv(accounts.ACCOUNTS_ENV, str(tmp_path / "registry"))
    with pytest.raises(ValueError, match="'web' has no budget account.*run on it first"):
        BudgetAccount.for_source("app", delta=DELTA, digest="a" * 64, shares_users_with="web")
    web = BudgetAccount.for_source("web", cap=3.0, delta=DELTA, digest="b" * 64)
    app = BudgetAccount.for_source("app", delta=DELTA, digest="a" * 64, shares_users_with="web")
    assert (app.path, app.identity, app.cap) == (web.path, web.identity, 3.0)
    assert BudgetAccount.for_source("app", delta=DELTA, digest="c" * 64).identity == web.identity
    BudgetAccount.for_source("tv", delta=DELTA, digest="9" * 64)
    with pytest.raises(ValueError, match="'tv' already has its own budget account"):
        BudgetAccount.for_source("tv", delta=DELTA, digest="9" * 64, shares_users_with="web")


@pytest.mark.parametrize("where", ["local", "gs"])
def test_concurrent_first_runs_of_a_source_make_one_account(tmp_path, where, request, monkeypatch):
    """Four processes open the first ledgers of one named source (each its own week's rows) at once:
    the registry's lock lets one create the account, and every ledger charges that one. Locally the
    lock is flock and the entry and account are created only where none is (a hard link). On gs://
    the same holds on GCS through generation preconditions, which the emulator does NOT honour (it
    ignores ifGenerationMatch: tests/schemas/test_storage.py), so there the four ledgers are opened
    one after another, in this process, and the test checks the registry's objects, not the race."""
    import subprocess
    import sys
    import textwrap

    base = request.getfixturevalue("gcs_path") if where == "gs" else str(tmp_path)
    monkeypatch.setenv(accounts.ACCOUNTS_ENV, f"{base}/registry")
    script = textwrap.dedent(f"""
        import sys
        from pipelines.releases.release import PrivacySettings
        week = sys.argv[1]
        settings = PrivacySettings(epsilon=1.0, delta={DELTA}, source="shop", digest=week * 64)
        ledger = settings.open_ledger("{base}/run-" + week + "/ledger.parquet", "user")
        print(ledger.budget["account_id"], flush=True)
    """)
    if where == "gs":  # no precondition on the emulator: no race to win there
        from pipelines.releases.release import PrivacySettings

        identities = {
            PrivacySettings(epsilon=1.0, delta=DELTA, source="shop", digest=week * 64)
            .open_ledger(f"{base}/run-{week}/ledger.parquet", "user")
            .budget["account_id"]
            for week in "abcd"
        }
    else:
        runs = [
            subprocess.Popen([sys.executable, "-c", script, week], stdout=subprocess.PIPE, text=True) for week in "abcd"
        ]
        identities = {run.communicate(timeout=120)[0].strip() for run in runs}
        assert all(run.returncode == 0 for run in runs)
    assert len(identities) == 1 and "" not in identities
    fs, inner = storage.filesystem(f"{base}/registry/digests")
    digests = fs.ls(inner)
    assert len(digests) == 4


def test_a_stale_view_of_the_registry_still_finds_the_one_account(tmp_path, monkeypatch):
    """A run that saw no entry for its source (a lease lost under load, another process creating the
    account at the same moment) cannot make a second account: the entry and the account are created
    only where none is, so it ends on the account the other made."""
    monkeypatch.setenv(accounts.ACCOUNTS_ENV, str(tmp_path / "registry"))
    first = BudgetAccount.for_source("shop", delta=DELTA, digest="a" * 64)
    seen = storage.exists
    stale = {"shop.json": 2, "shop.account.json": 2}  # the entry and the account look absent at first

    def exists(path):
        name = path.rsplit("/", 1)[-1]
        if stale.get(name):
            stale[name] -= 1
            return False
        return seen(path)

    monkeypatch.setattr(storage, "exists", exists)
    second = BudgetAccount.for_source("shop", delta=DELTA, digest="b" * 64)
    assert not any(stale.values()) and second.identity == first.identity and second.path == first.path
