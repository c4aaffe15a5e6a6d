"""The privacy ledger: every release of a run, in order, against the run's budget.

The ledger is a table (schemas.tables.LEDGER) stored with the run's outputs; its metadata holds
the budget: target (epsilon, delta), the accountant, the unit of privacy and the planned noise
multipliers. `record` is called *before* a release is computed: it composes the new event with
every recorded one using dp-accounting and refuses the release if the total would exceed the
budget; otherwise it appends the release and returns its index, which keys the release's noise.

A release is identified by its name. Recording a name again with the same event and fingerprint
returns the existing index without spending anything (a rerun or a resumed run reproduces the
same release); with a different event or fingerprint it is refused.

What the ledger proves: the listed releases are all the run made from private data, and their
composition is (epsilon_spent, delta)-DP for the unit of privacy it states. The run's seed file
lists the releases recorded here too (privacy.seeds), so a ledger that lost rows is refused, not
silently restarted; the ledger is one Parquet file replaced in one atomic step.

When the budget names a budget account (privacy.lifetime_budget), every release is also charged there,
before it is recorded here: the data source's lifetime epsilon over all runs stays under the
account's cap. `record` is the one writer; callers hold the release lock
(pipelines.base.lock.release_lock) around it, so two processes releasing into one ledger get distinct
indices and both rows.

Privacy: a release is recorded, and charged to the data source's account, before it is made; one
past the budget is refused with nothing recorded.
"""

from __future__ import annotations

import datetime
import json
import math
import secrets
from typing import TYPE_CHECKING

import pyarrow as pa

from privacy import accounting
from privacy.lifetime_budget import AccountMissingError, BudgetAccount
from schemas import storage
from schemas.errors import UserError
from schemas.tables import LEDGER, validate_ledger

if TYPE_CHECKING:
    import dp_accounting

_TOLERANCE = 1e-9  # relative slack for floating point in the budget comparison


class BudgetExceededError(UserError):
    """A release that would take the run past its privacy budget."""


class ReleaseConflictError(UserError):
    """A release recorded before under the same name with other parameters or inputs."""


class Ledger:
    """The releases of one run and its budget; persisted atomically after every change."""

    def __init__(self, path: str, budget: dict, rows: list[dict]):
        self.path, self.budget, self.rows = path, budget, rows

    @classmethod
    def create(
        cls,
        path: str,
        epsilon: float,
        delta: float,
        *,
        accountant: str = accounting.DEFAULT_ACCOUNTANT,
        unit: str = "user",
        multipliers: dict | None = None,
        account: str | None = None,
        account_id: str | None = None,
    ) -> Ledger:
        """A new, empty ledger with a budget (and the path of its data source's budget account, if
        any). epsilon = inf is a non-private run (no cap)."""
        if epsilon != math.inf:
            accounting.check_budget(epsilon, delta)
        elif not 0 < delta < 1:
            raise UserError(f"delta must be in (0, 1), got {delta}")
        accounting.make_accountant(accountant)
        if unit not in ("user", "example"):
            raise UserError(f"unit of privacy must be 'user' or 'example', got {unit!r}")
        budget = {
            "epsilon": epsilon,
            "delta": delta,
            "accountant": accountant,
            "unit": unit,
            "multipliers": multipliers or {},
            "id": secrets.token_hex(16),
        }  # the ledger's identity, which its seed file is bound to (a copy keeps it, a new ledger never has it)
        if account is not None:
            budget["account"] = account
            budget["account_id"] = account_id or BudgetAccount.open(account).identity
        ledger = cls(path, budget, [])
        ledger.save()
        return ledger

    @classmethod
    def open(cls, path: str) -> Ledger:
        try:
            table = validate_ledger(storage.read_table(path))
        except storage.MissingTableError:
            raise storage.MissingTableError(f"privacy ledger not found: {path}") from None
        raw = (table.schema.metadata or {}).get(b"budget")
        if raw is None:
            raise UserError(f"{path}: ledger has no budget in its metadata")
        budget = json.loads(raw)
        budget["epsilon"] = float(budget["epsilon"])
        return cls(path, budget, table.to_pylist())

    @classmethod
    def open_or_create(cls, path: str, **budget) -> Ledger:
        """Open the ledger at `path`, checking it has this budget, or create it."""
        if not storage.exists(path):
            return cls.create(path, **budget)
        ledger = cls.open(path)
        expected = {"accountant": accounting.DEFAULT_ACCOUNTANT, "unit": "user", **budget}
        expected["multipliers"] = expected.get("multipliers") or {}
        if expected.get("account") is None:
            expected.pop("account", None)
        expected.pop("account_id", None)
        if any(ledger.budget.get(key) != value for key, value in expected.items()):
            raise UserError(
                f"{path}: the run's ledger has budget {ledger.budget}, not {expected}; a run keeps one budget"
            )
        return ledger

    def reload(self) -> None:
        """Take in what other processes recorded since this ledger was read. A ledger that lost
        rows it had, or vanished, is refused: its releases happened and still count."""
        if not storage.exists(self.path):
            raise UserError(
                f"{self.path}: the privacy ledger was deleted while in use ({len(self.rows)} releases recorded); "
                "its releases still count, so nothing more is released until it is restored"
            )
        current = Ledger.open(self.path)
        if current.budget != self.budget:
            raise UserError(
                f"{self.path}: the ledger's budget was replaced while in use ({current.budget}, not {self.budget})"
            )
        known = {(row["release"], row["data_fingerprint"]) for row in current.rows}
        lost = [row["release"] for row in self.rows if (row["release"], row["data_fingerprint"]) not in known]
        if lost:
            raise UserError(
                f"{self.path}: the ledger lost releases {lost} while in use; they still count, so nothing more is "
                "released"
            )
        self.rows = current.rows

    @property
    def identity(self) -> str:
        """The ledger's random id (its path for a ledger made before ids existed)."""
        return self.budget.get("id") or storage.canonical(self.path)

    def account(self) -> BudgetAccount | None:
        """The data source's budget account this ledger charges, if any; refused when it is missing
        (deleted, renamed) or another account than the one the ledger was opened with (replaced)."""
        path = self.budget.get("account")
        if not path:
            return None
        if not storage.exists(path):
            raise AccountMissingError(
                f"{self.path}: the run's budget account {path} is missing (deleted, renamed or moved); its releases "
                "still "
                "count, so nothing more is released or published until it is restored"
            )
        account = BudgetAccount.open(path)
        if self.budget.get("account_id") not in (None, account.identity):
            raise AccountMissingError(
                f"{self.path}: {path} is not the budget account this run charges (id {self.budget['account_id']}): "
                "it was "
                "replaced; the original's releases still count, so nothing more is released or published until it is "
                "restored"
            )
        return account

    def check_account(self) -> dict | None:
        """The data source's lifetime budget as the account holds it ({path, epsilon, delta, cap,
        releases}), after checking that it lists every release of this ledger and is within its
        cap; None when the ledger charges no account."""
        account = self.account()
        if account is None:
            return None
        missing = account.missing(self.identity, [row["release"] for row in self.rows])
        if missing:
            raise UserError(
                f"{self.path}: releases {missing} are not charged to the budget account {account.path}; the account "
                "was replaced"
            )
        lifetime = account.epsilon()
        if account.cap is not None and lifetime > account.cap * (1 + _TOLERANCE):
            raise UserError(
                f"{account.path}: the data source's lifetime epsilon {lifetime:.6g} exceeds the account's cap "
                f"{account.cap:g}"
            )
        return {
            "path": account.path,
            "epsilon": lifetime,
            "delta": account.delta,
            "cap": account.cap,
            "window_days": account.document.get("window_days"),
            "releases": len(account.counted()),
        }

    def save(self) -> None:
        budget = {**self.budget, "epsilon": str(self.budget["epsilon"])}  # JSON has no inf
        table = pa.Table.from_pylist(self.rows, schema=LEDGER).replace_schema_metadata(
            {b"budget": json.dumps(budget).encode()}
        )
        storage.write_table_file(validate_ledger(table), self.path)

    @property
    def multipliers(self) -> dict[str, float]:
        """The noise multiplier of each release group: the plan's, or as `settle` revised them."""
        return self.budget.get("settled") or self.budget["multipliers"]

    def settle(self, multipliers: dict[str, float]) -> None:
        """Revise the plan's multipliers once, after a release its choice follows (the item Gram's
        second part: accounting.settle_item_gram); the same revision again is a no-op. The revised
        plan must spend no more than the budget: the caller calibrates it so."""
        if self.budget.get("settled") == multipliers:
            return
        if "settled" in self.budget:
            raise ReleaseConflictError(
                f"{self.path}: the run's plan was already settled as {self.budget['settled']}, not {multipliers}"
            )
        self.budget["settled"] = dict(multipliers)
        self.save()

    def events(self) -> list[dp_accounting.DpEvent]:
        return [accounting.event_from_json(json.loads(row["event"])) for row in self.rows]

    def epsilon_spent(self) -> float:
        """Epsilon of all recorded releases composed, at the budget's delta (0 when none)."""
        events = self.events()
        if not events:
            return 0.0
        return accounting.epsilon_of(events, self.budget["delta"], self.budget["accountant"])

    def epsilon_recorded(self) -> float:
        """`epsilon_spent` as `record` composed it with the latest release (0 when none): for progress
        lines and summaries, without composing every event again (a PLD: about 50 ms a call)."""
        return float(self.rows[-1]["epsilon_spent"]) if self.rows else 0.0

    def find(self, name: str) -> dict | None:
        return next((row for row in self.rows if row["name"] == name), None)

    def next_index(self, name: str) -> int:
        """The index a release of this name has, or will get when recorded next."""
        existing = self.find(name)
        return existing["release"] if existing is not None else len(self.rows)

    def record(self, name: str, event: dp_accounting.DpEvent, fingerprint: str) -> int:
        """Record a release before it is made; returns its index (the noise key).

        Refuses a release past the budget (nothing is recorded) and a name already recorded
        with another event or fingerprint.
        """
        event_json = json.dumps(accounting.event_to_json(event), sort_keys=True)
        existing = self.find(name)
        if existing is not None:
            if existing["event"] == event_json and existing["data_fingerprint"] == fingerprint:
                return existing["release"]
            raise ReleaseConflictError(
                f"{self.path}: release {name!r} was already made with other parameters or inputs; "
                "a run makes each release once"
            )
        epsilon = accounting.epsilon_of(self.events() + [event], self.budget["delta"], self.budget["accountant"])
        cap = self.budget["epsilon"]
        if epsilon > cap * (1 + _TOLERANCE):
            raise BudgetExceededError(
                f"release {name!r} would bring the run to epsilon {epsilon:.4g} at delta {self.budget['delta']:g}, "
                f"over its budget of {cap:g} (already spent {self.epsilon_spent():.4g}); nothing was released"
            )
        account = self.account()
        if account is not None:  # charged first: a crash before the row below over-counts, never under-counts
            missing = account.missing(self.identity, [row["release"] for row in self.rows])
            if missing:
                raise AccountMissingError(
                    f"{self.path}: releases {missing} of this run are not charged to its budget account "
                    f"{account.path}: the "
                    "account was replaced or rolled back; they still count, so nothing more is released"
                )
            account.charge(
                self.identity,
                len(self.rows),
                name,
                event,
                fingerprint=fingerprint,
                accountant=self.budget["accountant"],
            )
        noise = getattr(event, "noise_multiplier", getattr(getattr(event, "event", None), "noise_multiplier", 0.0))
        self.rows.append(
            {
                "release": len(self.rows),
                "name": name,
                "event": event_json,
                "noise_multiplier": float(noise),
                "epsilon_spent": epsilon,
                "delta": self.budget["delta"],
                "data_fingerprint": fingerprint,
                "recorded_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            }
        )
        self.save()
        return len(self.rows) - 1

    def describe(self) -> str:
        """The ledger as a human-readable table."""
        b = self.budget
        lines = [
            f"privacy ledger {self.path}",
            f"  budget: epsilon {b['epsilon']:g}, delta {b['delta']:g}, {b['unit']}-level, {b['accountant'].upper()} "
            "accountant",
            f"  {'#':>3}  {'release':<24} {'noise mult.':>11} {'epsilon after':>14}",
        ]
        for row in self.rows:
            lines.append(
                f"  {row['release']:>3}  {row['name']:<24} {row['noise_multiplier']:>11.4g} "
                f"{row['epsilon_spent']:>14.4g}"
            )
        lines.append(f"  epsilon spent: {self.epsilon_spent():.4g} of {b['epsilon']:g}")
        account = self.account()
        if account is not None:
            lines.append(f"  {account.describe()}")
        return "\n".join(lines)
