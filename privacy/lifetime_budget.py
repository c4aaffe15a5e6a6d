"""The budget account of a data source: every run's releases on the same users, composed.

A run's ledger bounds one run; the same users are retrained weekly. The account, a JSON document
(one per data source), lists every release of every run that charged it, with its dp-accounting
event; its lifetime epsilon composes them all (`epsilon`), and a release that would take it past
its cap is refused before it is made (`charge`, called by `Ledger.record` under the account's own
release lock). Accountants (PLD, RDP) compose at equal shares of delta; an optional window of N days lets
older releases stop counting, an operator's policy, not something DP provides.

A data source is an identity an operator names (`--data-source`, at ingest or per run): every run on
it, whatever its rows this week, composes into its one account. Interactions without a name are
identified by their content digest. The registry (`$SSP_BUDGET_ACCOUNTS`, default
`~/.ssp/budget-accounts`) names each source's one account and that account's id (`for_source`), so
a second, missing, replaced or rolled-back account is refused, never created anew; it also records
each content digest's source, so the same rows under a second name are refused. docs/privacy.md
("The budget account of a data source") has every rule, why, and what it trusts the operator with.

Privacy: deleting a run's ledger and seed does not give the users a fresh budget. A charge is
written before the ledger row it accounts for (a crash leaves the account over-charged, never
under), keyed by (ledger, release index, inputs' fingerprint), so a rerun charges nothing more and
a copied run folder's release on other inputs is charged again; a release without noise
is refused on a capped account. The registry is the root of trust: keep it where operators cannot
delete it unnoticed.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import re
import secrets
from typing import TYPE_CHECKING

from privacy import accounting
from schemas import storage
from schemas.errors import UserError

if TYPE_CHECKING:
    import dp_accounting

_TOLERANCE = 1e-9
ACCOUNTS_ENV = "SSP_BUDGET_ACCOUNTS"  # the registry folder of the data sources' accounts


def accounts_home() -> str:
    """The registry folder: $SSP_BUDGET_ACCOUNTS, or ~/.ssp/budget-accounts."""
    return os.environ.get(ACCOUNTS_ENV) or os.path.join(os.path.expanduser("~"), ".ssp", "budget-accounts")


@contextlib.contextmanager
def registry_at(folder: str):
    """$SSP_BUDGET_ACCOUNTS set to `folder` for the block (an audit's or a forecast's throwaway
    accounts never reach the machine's registry), as it was afterwards."""
    before = os.environ.get(ACCOUNTS_ENV)
    os.environ[ACCOUNTS_ENV] = folder
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ACCOUNTS_ENV, None)
        else:
            os.environ[ACCOUNTS_ENV] = before


def private_registry() -> str:
    """The registry folder, created readable by its owner alone; an existing one that others can
    read is refused (whoever can write it can roll a source's budget back)."""
    home = accounts_home()
    storage.check_private(home, "the budget-account registry")  # a local folder others can read: refused
    storage.make_private_folder(home)
    return home


class AccountMissingError(UserError):
    """A data source's account that the registry or a ledger names, but that is gone or replaced."""


class AccountCapError(UserError):
    """A release that would take a data source's lifetime budget past its cap."""


SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_source_name(flag: str, name: str) -> None:
    """Refuse a data source name that could not name a registry file (letters, digits, . _ -)."""
    if not isinstance(name, str) or not SOURCE_NAME.fullmatch(name):
        raise UserError(f"{flag} must be a name of letters, digits, '.', '_' and '-' (128 at most), got {name!r}")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


class BudgetAccount:
    """The lifetime budget of one data source, persisted atomically after every change."""

    def __init__(self, path: str, document: dict):
        self.path, self.document = path, document

    @classmethod
    def open_or_create(
        cls,
        path: str,
        cap: float | None = None,
        delta: float = 1e-5,
        accountant: str = "pld",
        window_days: float | None = None,
        source: str | None = None,
    ) -> BudgetAccount:
        """The account at `path`, created with this cap, delta, accountant and window if new. An
        existing account keeps its own settings; a different cap or window given for it is refused
        (changing the policy of a data source is an explicit edit, not a side effect of a run)."""
        if storage.exists(path):
            account = cls.open(path)
            for key, value in (("cap", cap), ("window_days", window_days)):
                if value is not None and account.document.get(key) != value:
                    raise UserError(
                        f"{path}: the budget account has {key} {account.document.get(key)}, not {value}; an account "
                        "keeps its policy"
                    )
            return account
        if cap is not None and not (cap > 0):
            raise UserError(f"the account's lifetime epsilon cap must be > 0, got {cap}")
        if window_days is not None and not (math.isfinite(window_days) and window_days > 0):
            raise UserError(f"the account's window must be a positive number of days, got {window_days}")
        accounting.check_budget(1.0, delta)
        accounting.make_accountant(accountant)
        account = cls(
            path,
            {
                "cap": cap,
                "delta": delta,
                "accountant": accountant,
                "window_days": window_days,
                "charges": [],
                "id": secrets.token_hex(16),
                "source": source,
            },
        )
        if not storage.create_json(account.document, path, private=True):  # another process made it first
            return cls.open_or_create(path, cap, delta, accountant, window_days, source)
        return account

    @classmethod
    def for_source(
        cls,
        source: str,
        path: str | None = None,
        cap: float | None = None,
        delta: float = 1e-5,
        accountant: str = "pld",
        window_days: float | None = None,
        *,
        digest: str | None = None,
        shares_users_with: str | None = None,
    ) -> BudgetAccount:
        """The one account of the data source `source` (the name an operator gave it, or the content
        digest of interactions that have none), through the registry (module docstring): created at
        `path` (default: in the registry folder) if the source has none; refused if it has one
        elsewhere, or if the one it has is missing or replaced. `digest`, the content digest of this
        run's interactions, is checked against every other name's; `shares_users_with` names the
        source whose account a new one shares (their users overlap). Callers hold the registry's lock."""
        private_registry()
        if digest is not None:
            source = cls._named_digest(source, digest)
        entry_path = storage.join(accounts_home(), f"{source}.json")
        if not storage.exists(entry_path) and shares_users_with is not None:
            other = cls._entry(shares_users_with, why=f"{source!r} is declared to share its users with it")
            storage.create_json({**other, "source": source, "shares_users_with": shares_users_with}, entry_path)
        if storage.exists(entry_path):
            entry = storage.read_json(entry_path)
            if shares_users_with is not None and entry.get("shares_users_with") != shares_users_with:
                raise UserError(
                    f"data source {source!r} already has its own budget account {entry['account']} (registry "
                    f"{entry_path}): sharing users with {shares_users_with!r} is declared before its first run"
                )
            if path is not None and storage.canonical(path) != entry["account"]:
                raise UserError(
                    f"this data source already has its budget account {entry['account']}; one data source keeps one "
                    f"account (registry {entry_path}): give that one, or no --budget-account"
                )
            if not storage.exists(entry["account"]):
                raise AccountMissingError(
                    f"the budget account {entry['account']} of this data source (registry {entry_path}) is missing: "
                    "deleted, renamed or moved. Its releases still count; restore it (nothing was released)"
                )
            account = cls.open_or_create(entry["account"], cap, delta, accountant, window_days)
            if account.document.get("id") != entry["id"]:
                raise AccountMissingError(
                    f"{entry['account']} is not the budget account the registry {entry_path} names (id {entry['id']}): "
                    "it was replaced. The releases of the original still count; restore it (nothing was released)"
                )
            return account
        target = (
            storage.canonical(path) if path is not None else storage.join(accounts_home(), f"{source}.account.json")
        )
        if storage.exists(target):
            raise UserError(
                f"{target} is a budget account the registry {accounts_home()} does not list for this data source; "
                "an account serves the data source it was made for: give another path"
            )
        account = cls.open_or_create(target, cap, delta, accountant, window_days, source=source)
        if not storage.create_json({"source": source, "account": target, "id": account.document["id"]}, entry_path):
            return cls.for_source(  # another process named the source's account first: that one is the account
                source, path, cap, delta, accountant, window_days, shares_users_with=shares_users_with
            )
        return account

    @staticmethod
    def _entry(source: str, why: str) -> dict:
        entry_path = storage.join(accounts_home(), f"{source}.json")
        if not storage.exists(entry_path):
            raise UserError(
                f"data source {source!r} has no budget account in the registry {accounts_home()} ({why}): run on it "
                "first"
            )
        return storage.read_json(entry_path)

    @staticmethod
    def _named_digest(source: str, digest: str) -> str:
        """The source these interactions are accounted to: `source`, after recording that their
        content digest is its (interactions under no name: the named source that has them, if any).
        The same interactions under a second name are refused: they would start a second budget."""
        index = storage.join(accounts_home(), "digests", f"{digest}.json")
        owner = storage.read_json(index)["source"] if storage.exists(index) else None
        if owner is None and source != digest and storage.exists(storage.join(accounts_home(), f"{digest}.json")):
            owner = digest  # accounted before, under no name
        if source == digest:
            return owner or source
        if owner is not None and owner != source:
            named = f"data source {owner!r}" if owner != digest else "a data source without a name (its content digest)"
            raise UserError(
                f"these interactions (content digest {digest[:16]}...) are already accounted to {named} in the "
                f"registry {accounts_home()}; the same rows under a second name, {source!r}, would start a second "
                f"budget: name them {owner!r}"
            )
        if owner is None:
            storage.write_json({"source": source}, index)
        return source

    @classmethod
    def open(cls, path: str) -> BudgetAccount:
        try:
            document = storage.read_json(path)
            for key in ("delta", "accountant", "charges"):
                document[key]
        except storage.MissingTableError:
            raise storage.MissingTableError(f"budget account not found: {path}") from None
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path} is not a budget account ({type(exc).__name__}: {exc})") from None
        if document.get("cap") is not None:
            document["cap"] = float(document["cap"])
        return cls(path, document)

    def reload(self) -> None:
        self.document = BudgetAccount.open(self.path).document

    def _save(self) -> None:
        storage.write_json(self.document, self.path, private=True)

    @property
    def cap(self) -> float | None:
        return self.document.get("cap")

    @property
    def delta(self) -> float:
        return float(self.document["delta"])

    def counted(self, now: datetime.datetime | None = None) -> list[dict]:
        """The charges that count against the cap (all, or those inside the window)."""
        window = self.document.get("window_days")
        if window is None:
            return list(self.document["charges"])
        since = (now or _now()) - datetime.timedelta(days=window)
        return [c for c in self.document["charges"] if datetime.datetime.fromisoformat(c["recorded_at"]) >= since]

    def epsilon(
        self,
        extra: list[dp_accounting.DpEvent] = (),
        now: datetime.datetime | None = None,
        extra_accountant: str | None = None,
    ) -> float:
        """The lifetime epsilon at the account's delta: every counted charge (and `extra`, accounted
        by `extra_accountant`) composed, per accountant, the groups' epsilons added (module docstring)."""
        own = self.document["accountant"]
        groups: dict[str, list] = {}
        for charge in self.counted(now):
            groups.setdefault(charge.get("accountant", own), []).append(
                accounting.event_from_json(json.loads(charge["event"]))
            )
        if extra:
            groups.setdefault(extra_accountant or own, []).extend(extra)
        share = self.delta / max(len(groups), 1)
        return sum(accounting.epsilon_of(events, share, name) for name, events in groups.items())

    @property
    def identity(self) -> str | None:
        return self.document.get("id")

    def find(self, ledger: str, release: int, fingerprint: str | None = None) -> dict | None:
        """The charge of release `release` of `ledger`; with `fingerprint`, the one on those inputs
        (a charge recorded before charges had fingerprints matches any)."""
        return next(
            (
                c
                for c in self.document["charges"]
                if c["ledger"] == ledger
                and c["release"] == release
                and (fingerprint is None or c.get("fingerprint") in (None, fingerprint))
            ),
            None,
        )

    def charge(
        self,
        ledger: str,
        release: int,
        name: str,
        event: dp_accounting.DpEvent,
        *,
        fingerprint: str,
        accountant: str | None = None,
    ) -> None:
        """Charge release `release` of `ledger` on the inputs `fingerprint` names (composed by
        `accountant`, default the account's) to the account, or refuse it past the cap or without
        noise on a capped account (nothing is charged). The same release on the same inputs again
        (a rerun) charges nothing; on other inputs (a copy of the run folder released on other
        data) it is another release, charged as one."""
        self.reload()
        event_json = json.dumps(accounting.event_to_json(event), sort_keys=True)
        existing = self.find(ledger, release, fingerprint)
        if existing is not None:
            if existing["event"] != event_json:
                raise UserError(
                    f"{self.path}: release {release} of {ledger} was charged with another event; the ledger was "
                    "replaced"
                )
            return
        accountant = accountant or self.document["accountant"]
        import dp_accounting  # where used (privacy.accounting)

        if self.cap is not None and isinstance(event, dp_accounting.NonPrivateDpEvent):
            raise AccountCapError(
                f"release {name!r} has no noise (noise multiplier 0, infinite epsilon), which the capped budget "
                f"account {self.path} "
                f"(cap {self.cap:g}) cannot take; nothing was released"
            )
        if self.cap is not None:
            lifetime = self.epsilon([event], extra_accountant=accountant)
            if lifetime > self.cap * (1 + _TOLERANCE):
                raise AccountCapError(
                    f"release {name!r} would bring the data source's lifetime epsilon to {lifetime:.4g} at delta "
                    f"{self.delta:g}, over the cap "
                    f"{self.cap:g} of its budget account {self.path} (already spent {self.epsilon():.4g} over "
                    f"{len(self.counted())} releases); "
                    "nothing was released"
                )
        self.document["charges"].append(
            {
                "ledger": ledger,
                "release": release,
                "fingerprint": fingerprint,
                "name": name,
                "event": event_json,
                "accountant": accountant,
                "recorded_at": _now().isoformat(timespec="seconds"),
            }
        )
        self._save()

    def start_round(self, ledger: str, release: int) -> None:
        """Record on release `release`'s charge that a federated round of it starts, or refuse a
        second one: its noise is fresh per round, and a run folder copied before the round would
        otherwise run it again in the copy, under the same charge (callers hold the account's lock)."""
        self.reload()
        charge = self.find(ledger, release)
        if charge is None:
            raise UserError(
                f"{self.path}: release {release} of ledger {ledger} is not charged; a round starts after its release"
            )
        if charge.get("round") == "started":
            raise UserError(
                f"a federated round of release {release} already ran (recorded in the budget account {self.path}, "
                "which every copy "
                "of the run charges): a new round would draw new noise for the same statistics, uncharged; start a "
                "new run"
            )
        charge["round"] = "started"
        self._save()

    def round_unrevealed(self, ledger: str, release: int) -> None:
        """Record that the round was refused before any share was revealed: it may run again."""
        self.reload()
        self.find(ledger, release)["round"] = "refused unrevealed"
        self._save()

    def missing(self, ledger: str, releases: list[int]) -> list[int]:
        """The releases of `ledger` the account has no charge for."""
        return [r for r in releases if self.find(ledger, r) is None]

    def describe(self) -> str:
        counted = self.counted()
        runs = len({c["ledger"] for c in counted})
        cap = "no cap" if self.cap is None else f"cap {self.cap:g}"
        window = (
            "lifetime" if self.document.get("window_days") is None else f"last {self.document['window_days']:g} days"
        )
        return (
            f"budget account {self.path}: epsilon {self.epsilon():.4g} at delta {self.delta:g} ({window}, {cap}) "
            f"over {len(counted)} releases of {runs} run(s)"
        )
