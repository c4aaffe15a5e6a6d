"""schemas.errors: a SchemaError's message names its table, column and row; both refusals are ValueErrors."""

import pytest

from schemas.errors import SchemaError, UserError


@pytest.mark.parametrize(
    "column, row, message",
    [
        ("label", 3, "ratings: column 'label', row 3: is not finite"),
        ("label", None, "ratings: column 'label': is not finite"),
        (None, 0, "ratings: row 0: is not finite"),
        (None, None, "ratings: is not finite"),
    ],
)
def test_the_message_names_the_table_then_the_column_and_the_row_it_knows(column, row, message):
    error = SchemaError("ratings", "is not finite", column, row)
    assert str(error) == message
    assert (error.table, error.problem, error.column, error.row) == ("ratings", "is not finite", column, row)


def test_a_schema_error_is_a_user_error_and_a_value_error():
    with pytest.raises(ValueError, match="^items: row 1: duplicate id$") as caught:
        raise SchemaError("items", "duplicate id", row=1)
    assert isinstance(caught.value, UserError)
    assert not issubclass(UserError, SchemaError)
