"""The project's refusals: `UserError`, what the user can act on, and `SchemaError`, a table that
breaks its contract (it names the table, the column and the row).

Privacy: an error's text goes to the operator on the trusted side; it is not a release.
"""

from __future__ import annotations


class UserError(ValueError):
    """A refusal the user can act on: bad input, a bad setting, a run or budget that does not allow
    the command. A command ends with its one line and exit status 2 (pipelines.base.command); any
    other exception is a bug. A ValueError, so that callers catching those still catch it."""


class SchemaError(UserError):
    """A table that does not satisfy its schema.

    `row` is the 0-based row index inside the table that was validated (None when the problem is
    not tied to one row); callers that know where the rows came from (a file and a line) re-raise
    with that location, see `pipelines.data.movielens`.
    """

    def __init__(self, table: str, problem: str, column: str | None = None, row: int | None = None):
        self.table, self.problem, self.column, self.row = table, problem, column, row
        where = f"column '{column}'" if column else ""
        if row is not None:
            where += f"{', ' if where else ''}row {row}"
        super().__init__(f"{table}: {where + ': ' if where else ''}{problem}")
