"""`ssp recommend`: top-k items for users, from a published model alone, solved on the client.

A publication (`ssp publish`) holds the item embeddings, the encoder (SavedModel) and `model.json`,
the public settings of the user side: the protocol, the ridge lambda_u, the implicit-feedback
gravity, the DP mean rating and the positive threshold. A user's embedding is solved here from
their own history against the published item embeddings, exactly as the run's evaluation folds in
held-out users (`trainer.evaluate.ranking_report`: `trainer.solve.ridge_solve` with lambda_u
scaled by the history's length, the gravity alpha V^T V over the catalog, labels 1 for positives or
rating minus the DP mean; for the logistic loss `trainer.solve.logistic_solve`; for a ranking model
the DP counts as one more item column, `trainer.evaluate.with_popularity`), then every item outside
the history (with `exclude_seen`) is scored by u . v and the k best are returned: for a ratings
model the score is the predicted rating on the model's scale (DP mean + u . v, within the scale),
for a ranking model u . v (relative: only its order means something). A user whose history names
no catalog item (a new user) gets the DP popularity ranking instead, the counts release the
publication ships, scored by the items' DP counts. Items added to the catalog after training are
embedded from their public features through the encoder's `embed_features` signature and scored
with the rest.

Privacy: the history never leaves the client; nothing here writes to the run or the trainer. The
inputs are public (the publication) and the user's own data.
"""

from __future__ import annotations

import argparse
import io
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from schemas import storage
from schemas.arrays import list_column_to_matrix
from schemas.errors import UserError
from schemas.ids import IdIndex
from schemas.tables import validate_item_embeddings
from trainer import feature_popularity, metrics
from trainer.evaluate import popularity_position, user_item_mask, with_popularity
from trainer.solve import confidence, logistic_solve, ridge_solve, user_bias_ridge

MODEL_SETTINGS = "model.json"
TITLES = "titles.parquet"  # a publication's (item_id, title) of the catalog items with a title
ITEM_KEYS = "item_keys.parquet"  # a publication's (item_id, item_key) when the catalog's ids are text
LOGGER = logging.getLogger("ssp")  # the commands' progress logger (pipelines.base.logs sets its verbosity)
RECOMMENDATIONS = pa.schema(
    [
        pa.field("user_id", pa.int64(), nullable=False),
        pa.field("rank", pa.int32(), nullable=False),
        pa.field("item_id", pa.int64(), nullable=False),
        pa.field("score", pa.float64(), nullable=False),
    ]
)


def keyed(table: pa.Table, source: str, columns: dict[str, str]) -> pa.Table:
    """`table` with its id columns ({"user_id": its column, "item_id": its column}) renamed to
    user_id and item_id as int64, each checked first: present, integer ids, no empty value. Anything
    else is one ValueError naming `source`, the column and the row."""
    flags = {"user_id": "--user-col", "item_id": "--item-col"}
    if table.num_rows == 0:
        raise UserError(f"{source} holds no rows (a header alone?): give one row per interaction")
    for name, column in columns.items():
        if column not in table.column_names:
            raise UserError(
                f"{source} has no {column!r} column (columns: {', '.join(table.column_names)}); name its "
                f"{name.removesuffix('_id')} id column with {flags[name]}"
            )
        values = table[column]
        if values.null_count:
            raise UserError(
                f"{source}: row {pc.index(pc.is_null(values), True).as_py() + 1} has no {column} (an empty value)"
            )
        trimmed = pc.utf8_trim_whitespace(values) if pa.types.is_string(values.type) else None
        if trimmed is not None and pc.all(pc.match_substring_regex(trimmed, r"^[+-]?[0-9]+(\.0*)?$")).as_py():
            values = pc.cast(trimmed, pa.float64() if pc.any(pc.match_substring(trimmed, ".")).as_py() else pa.int64())
        if pa.types.is_floating(values.type) and pc.all(pc.equal(pc.floor(values), values)).as_py() is not False:
            values = pc.cast(values, pa.int64())
        if not pa.types.is_integer(values.type):
            example = values[0].as_py() if len(values) else None
            raise UserError(
                f"{source}: column {column!r} holds {values.type} values (e.g. {example!r}), not integer ids: give "
                "the integer "
                "ids the model was trained on"
            )
        table = table.set_column(table.column_names.index(column), name, pc.cast(values, pa.int64()))
    return table


def read_user_table(path: str, ids: tuple[str, ...] = ()) -> pa.Table:
    """A Parquet or CSV file (or a folder of Parquet parts), local or gs://, as an Arrow table; a
    CSV's `ids` columns read as text (an id such as 007 keeps its zeros)."""
    fs, inner = storage.filesystem(path)
    if not fs.exists(inner):
        raise FileNotFoundError(f"{path} does not exist")
    if inner.endswith(".csv"):
        with fs.open(inner, "rb") as handle:
            return pacsv.read_csv(
                handle,
                convert_options=pacsv.ConvertOptions(
                    column_types=dict.fromkeys(ids, pa.string()), strings_can_be_null=True, null_values=[""]
                ),
            )
    try:
        return pq.read_table(inner, filesystem=fs)
    except pa.ArrowInvalid as exc:
        raise UserError(f"{path} is not a Parquet file or folder (a CSV file must end in .csv): {exc}") from None


@dataclass
class PublishedModel:
    """A publication's item embeddings (catalog order) and user-side settings."""

    path: str
    item_ids: np.ndarray
    vectors: np.ndarray  # float64, (items, d), plus the popularity column when model.json says so
    settings: dict
    popularity: np.ndarray | None = None  # the DP counts in catalog order (None: a publication without counts.parquet)
    feature_popularity: pa.Table | None = None  # mean DP count per feature value (trainer.feature_popularity)
    titles: pa.Table | None = None  # (item_id, title) of the catalog's titled items (None: the catalog has none)
    item_keys: pa.Array | None = None  # the catalog's text ids, sorted: item id i is item_keys[i - 1] (None: integers)

    @classmethod
    def load(cls, path: str) -> PublishedModel:
        """Open the publication at `path` (local or gs://), refusing one that is not complete."""
        if not storage.exists(storage.join(path, "_PUBLISHED")):
            raise UserError(
                f"{path} is not a complete publication (no _PUBLISHED marker); give the --to folder of `ssp publish`"
            )
        return cls.read(path)

    @classmethod
    def read(cls, path: str) -> PublishedModel:
        """The model from a publication's files, committed or not (`ssp publish` builds the serving
        SavedModel from them before its marker)."""
        settings_path = storage.join(path, MODEL_SETTINGS)
        if not storage.exists(settings_path):
            raise UserError(
                f"{path} has no {MODEL_SETTINGS} (published by an older version); publish the run again to a new folder"
            )
        settings = storage.read_json(settings_path)
        table = validate_item_embeddings(
            storage.read_table(storage.join(path, "item_embeddings.parquet")), dim=settings["dim"]
        )
        order = np.argsort(table["item_id"].to_numpy(), kind="stable")
        item_ids = table["item_id"].to_numpy()[order]
        vectors = list_column_to_matrix(table["embedding"], settings["dim"], "item embedding")[order]
        popularity = None
        if storage.exists(
            storage.join(path, "counts.parquet")
        ):  # the DP counts release (shipped since cold start uses it)
            counts = storage.read_table(storage.join(path, "counts.parquet"), columns=["item_id", "count"])
            popularity = np.ones(item_ids.size)
            popularity[
                IdIndex(item_ids).positions(
                    counts["item_id"].to_numpy(), f"item of {path}/counts.parquet with an embedding"
                )
            ] = counts["count"].to_numpy()
        if settings.get("popularity_column"):  # the evaluation's fold-in: the DP counts as one more column
            if popularity is None:
                raise UserError(
                    f"{path}: model.json folds users in with the DP counts, but counts.parquet is missing; publish "
                    "the run again"
                )
            vectors = with_popularity(vectors, popularity, settings.get("biases", False))
        by_features = storage.join(path, feature_popularity.FILE)
        means = storage.read_table(by_features) if storage.exists(by_features) else None
        titled = storage.join(path, TITLES)
        titles = storage.read_table(titled, columns=["item_id", "title"]) if storage.exists(titled) else None
        keyed_by = storage.join(path, ITEM_KEYS)
        keys = (
            storage.read_table(keyed_by).sort_by("item_id")["item_key"].combine_chunks()
            if storage.exists(keyed_by)
            else None
        )
        return cls(path, item_ids, vectors, settings, popularity, means, titles, keys)

    def key_of(self, item_ids: np.ndarray) -> np.ndarray:
        """The catalog's text ids of `item_ids` (a publication with `item_keys`)."""
        return np.asarray(self.item_keys.to_pylist(), object)[np.asarray(item_ids) - 1]

    def embed_new_items(self, items: pa.Table) -> np.ndarray:
        """Embeddings (float64, rows of `items`) of items from their public feature columns alone,
        through the published encoder's `embed_features` signature; in the popularity column, their
        popularity by features (trainer.feature_popularity) on the column's scale (0 for a publication
        without it)."""
        import tensorflow as tf

        from trainer.features import value_strings

        families = self.settings.get("feature_families")
        if not families:
            raise UserError(
                f"{self.path}: this model's encoder has no public features (--encoder id), so it cannot embed new items"
            )
        missing = [name for name in families if name not in items.column_names]
        if missing:
            raise UserError(
                f"the new items lack the feature column(s) {', '.join(missing)} (the model's families: "
                f"{', '.join(families)})"
            )
        for name, kind in families.items():  # a number the encoder's signature cannot read: refused, named
            if kind == "numeric":
                feature_popularity.numbers_of(items, name)
        inputs = {}
        for name in families:
            rows = value_strings(items, name)
            width = max((len(values) for values in rows), default=0)
            inputs[name] = tf.constant(
                [values + [""] * (width - len(values)) for values in rows], tf.string, shape=(len(rows), width)
            )
        with storage.read_folder(storage.join(self.path, "encoder")) as local:
            embed = tf.saved_model.load(local).signatures["embed_features"]
            embedded = embed(**inputs)["embedding"].numpy().astype(np.float64)
        missing = self.vectors.shape[1] - embedded.shape[1]
        at = popularity_position(embedded.shape[1], self.settings.get("biases", False))
        column = np.zeros(items.num_rows)
        if missing and self.feature_popularity is not None:  # the column is the DP counts times one scale
            scale = self.vectors[0, at] / max(self.popularity[0], 1.0)
            column = scale * feature_popularity.score_new_items(
                self.feature_popularity, items, families, float(np.maximum(self.popularity, 1.0).mean())
            )
        return np.insert(embedded, [at] * missing, column[:, None] if missing else 0.0, axis=1)

    def fold_in(
        self, users: np.ndarray, positions: np.ndarray, labels: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(sorted user ids, user embeddings) solved from history rows (catalog positions), as the
        run's evaluation folds in held-out users."""
        s = self.settings
        if s["protocol"] == "rmse":
            if labels is None:
                raise UserError(
                    "this model was trained on ratings (regression protocol): the history needs a label column (the "
                    "user's ratings)"
                )
            targets = labels - s["dp_mean"]
        elif (
            labels is not None and s.get("confidence_alpha") is not None
        ):  # implicit feedback: each item's count, its confidence
            targets = confidence(labels, s["confidence_alpha"])
        else:
            targets = np.ones(positions.size)
        v = self.vectors
        if s.get("loss") == "logistic":  # SSP-convex: every catalog item a negative, as its evaluation folds users in
            return logistic_solve(users, v[positions], v, s["lambda_u"])
        gravity = s["gravity"] * (v.T @ v) if s.get("gravity", 0) > 0 else None
        return ridge_solve(
            users,
            v[positions],
            targets,
            s["lambda_u"],
            scale_by_rows=True,
            gravity=gravity,
            bias_ridge=user_bias_ridge(s["protocol"], s.get("biases", False), s.get("lambda_bias")),
            prior=s.get("user_prior") or 0.0,
            confidence=s["protocol"] == "recall",
        )

    def recommend(
        self,
        history: pa.Table,
        k: int = 20,
        exclude_seen: bool = True,
        new_items: pa.Table | None = None,
        source: str = "the history",
        names: Callable[[np.ndarray], list] = list,
    ) -> pa.Table:
        """The top-k items (RECOMMENDATIONS: user_id, rank from 1, item_id, score) of every user in
        `history` (columns user_id, item_id and, for a regression model or explicit feedback, label;
        `source` names it in errors).

        Ranking protocol: only positives count (label above the model's positive threshold, every
        row without a label or for implicit feedback); `exclude_seen` leaves out every item of the
        history. History items missing from the catalog are ignored and counted on stderr (listed
        with -v); a user left with nothing to fold in gets the DP popularity ranking. A ratings
        model refuses a label outside its rating scale. `new_items` (item_id and the feature
        columns) are embedded and ranked too. `names`: the user's own ids of item ids, for messages."""
        if k < 1:
            raise UserError(f"--k must be a positive number of items, got {k}")
        history = keyed(history, source, {"user_id": "user_id", "item_id": "item_id"})
        users = history["user_id"].to_numpy()
        items = history["item_id"].to_numpy()
        labels = self._labels(history, source)
        threshold = self.settings.get("positive_threshold")
        known = np.isin(items, self.item_ids)
        if not known.all():
            unknown = np.unique(items[~known])
            LOGGER.info(
                f"{(~known).sum()} history row(s) name {unknown.size} item(s) outside the model's catalog: ignored"
                + ("" if LOGGER.isEnabledFor(logging.DEBUG) else " (-v lists them)")
            )
            if LOGGER.isEnabledFor(logging.DEBUG):
                LOGGER.debug(f"items outside the catalog: {', '.join(map(str, names(unknown)))}")
        keep = known.copy()  # the rows the user side is solved from
        if self.settings["protocol"] == "recall" and labels is not None and threshold is not None:
            keep &= labels > threshold
        solved_users, solved = self.fold_in(
            *self._pairs(users[keep], items[keep], labels[keep] if labels is not None else None)
        )
        catalog_ids, vectors = self.item_ids, self.vectors
        if new_items is not None and new_items.num_rows:
            added = keyed(new_items, "the new items", {"item_id": "item_id"})["item_id"].to_numpy()
            if np.isin(added, self.item_ids).any():
                raise UserError(f"new item {added[np.isin(added, self.item_ids)][0]} is already in the model's catalog")
            catalog_ids, vectors = np.r_[catalog_ids, added], np.vstack([vectors, self.embed_new_items(new_items)])
        every_user = np.unique(users)
        out = []
        for start in range(0, every_user.size, 1024):
            chunk = every_user[start : start + 1024]
            u = np.zeros((chunk.size, vectors.shape[1]))
            found = np.isin(chunk, solved_users)
            u[found] = solved[np.searchsorted(solved_users, chunk[found])]
            scores = u @ vectors.T
            shown = (
                np.clip(scores + self.settings["dp_mean"], *self.settings["rating_range"])
                if self.settings["protocol"] == "rmse"
                else scores
            )
            if (
                self.popularity is not None
            ):  # a user with nothing to fold in: the DP popularity ranking (new items have no count)
                scores[~found] = shown[~found] = np.r_[self.popularity, np.zeros(catalog_ids.size - self.item_ids.size)]
            # every item of the history, liked or not
            seen = (
                user_item_mask(chunk, users[known], np.searchsorted(self.item_ids, items[known]), scores.shape[1])
                if exclude_seen
                else np.zeros(scores.shape, bool)
            )
            rows, cols = np.nonzero(metrics.top_k_mask(scores, seen, k) & ~seen)
            order = np.lexsort((cols, -scores[rows, cols], rows))  # each user's best first, ties by catalog position
            rows, cols = rows[order], cols[order]
            rank = np.arange(rows.size) - np.searchsorted(rows, rows) + 1
            out.append(
                pa.table(
                    {
                        "user_id": chunk[rows],
                        "rank": rank.astype(np.int32),
                        "item_id": catalog_ids[cols],
                        "score": shown[rows, cols],
                    },
                    schema=RECOMMENDATIONS,
                )
            )
        cold = np.setdiff1d(every_user, solved_users).size
        if cold:
            LOGGER.info(
                f"{cold} user(s) with no catalog item to fold in: "
                + (
                    "the DP popularity ranking (score: the DP count)"
                    if self.popularity is not None
                    else "every score 0 (this publication ships no DP counts; publish the run again)"
                )
            )
        table = pa.concat_tables(out) if out else RECOMMENDATIONS.empty_table()
        return self._titled(table, new_items)

    def _titled(self, table: pa.Table, new_items: pa.Table | None) -> pa.Table:
        """`table` with a `title` column (null where an item has none) when the publication ships
        titles or the new items carry a `title` column; as it is otherwise."""
        parts = [self.titles] if self.titles is not None else []
        if new_items is not None and "title" in new_items.column_names:
            parts.append(new_items.select(["item_id", "title"]))
        if not parts:
            return table
        ids = pa.array(np.concatenate([part["item_id"].to_numpy() for part in parts]))
        names = pa.concat_arrays([pc.cast(part["title"], pa.string()).combine_chunks() for part in parts])
        return table.append_column("title", pc.take(names, pc.index_in(table["item_id"], ids)))

    def _pairs(
        self, users: np.ndarray, items: np.ndarray, labels: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """(users, catalog positions, labels) to fold in from history rows: for implicit feedback one
        row per (user, item) whose label is its rows' counts summed (a label is a count, 1 without
        one), as training's split counts repeated plays; the rows as they are otherwise."""
        positions = np.searchsorted(self.item_ids, items)
        if self.settings.get("confidence_alpha") is None:
            return users, positions, labels
        pairs, at = np.unique(np.c_[users, positions], axis=0, return_inverse=True)
        counts = np.ones(users.size) if labels is None else labels
        return pairs[:, 0], pairs[:, 1], np.bincount(at.ravel(), weights=counts, minlength=pairs.shape[0])

    def _labels(self, history: pa.Table, source: str) -> np.ndarray | None:
        """The history's labels (None without a label column), each finite and, for a ratings model,
        on its rating scale."""
        if "label" not in history.column_names:
            return None
        labels = history["label"].to_numpy(zero_copy_only=False).astype(np.float64)
        bad = ~np.isfinite(labels)
        counts = self.settings.get("confidence_alpha") is not None  # implicit feedback: a label is a count
        if self.settings["protocol"] == "rmse":
            low, high = self.settings["rating_range"]
            bad |= (labels < low) | (labels > high)
            rule = f" (the model's rating scale is {low:g}..{high:g})"
        elif counts:
            bad |= labels < 1
            rule = " (an implicit-feedback model reads a label as a count: a number >= 1)"
        else:
            rule = " (a label must be a finite number)"
        if bad.any():
            row = int(np.argmax(bad))
            shown = "empty" if history["label"][row].as_py() is None else f"{labels[row]:g}"
            raise UserError(f"{source}: row {row + 1} has label {shown}{rule}")
        return labels


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="a publication folder written by `ssp publish` (local or gs://): its item embeddings, "
        "encoder and model.json are all that is read",
    )
    parser.add_argument(
        "--history",
        required=True,
        help="the users' own interactions, Parquet or CSV (local or gs://) with columns user_id, item_id "
        "and, for a model trained on ratings, label; they stay on this machine (nothing is sent to the trainer)",
    )
    parser.add_argument("--k", type=int, default=20, help="how many items to recommend per user (default: %(default)s)")
    parser.add_argument(
        "--include-seen",
        action="store_true",
        help="also recommend the items already in a user's history (by default they are "
        "left out, as the evaluation does)",
    )
    parser.add_argument(
        "--user-col",
        default="user_id",
        help="the history's user id column, any ids (the recommendations name it and its ids) (default: %(default)s)",
    )
    parser.add_argument(
        "--item-col",
        default="item_id",
        help="the item id column of the history and of --new-items: the catalog's ids, integers or text (the "
        "recommendations name it and give the catalog's ids) (default: %(default)s)",
    )
    parser.add_argument(
        "--label-col",
        help="for a model trained on ratings: the history's rating column (default: label)",
    )
    parser.add_argument(
        "--count-col",
        help="for a model trained on implicit feedback: the history's column of counts (plays of the item, "
        "numbers >= 1), summed per user and item as ssp ingest --count-col does (default: label; without one "
        "each row counts once)",
    )
    parser.add_argument(
        "--new-items",
        help="Parquet or CSV of catalog items added after training (the item id and the model's public feature "
        "columns; a bag's values separated by |): embedded from their features alone and ranked with the rest",
    )
    parser.add_argument(
        "--out",
        help="write the recommendations (user, rank, item, score; the history's column names) to this file, CSV or "
        "Parquet as its name ends (.csv, .parquet), instead of printing them as CSV. The score: for a ratings "
        "model the predicted rating on the model's scale; for a ranking model u . v, whose order alone means "
        "something; for a user with no catalog item in the history (who gets the DP popularity ranking) the "
        "item's DP count",
    )


def _bags_from_csv(items: pa.Table, families: dict) -> pa.Table:
    """A CSV catalog's bag columns ("a|b|c" strings) as lists of values (an empty string is no value:
    the encoder's signature treats "" as padding)."""
    for name, kind in families.items():
        if kind == "multivalent" and name in items.column_names and not pa.types.is_list(items[name].type):
            bags = pc.split_pattern(pc.fill_null(pc.cast(items[name], pa.string()), ""), "|")
            items = items.set_column(items.column_names.index(name), name, bags)
    return items


def _csv_field(text: str) -> str:
    """`text` as one CSV field: quoted (quotes doubled) when it holds a comma, a quote or a line break."""
    return '"' + text.replace('"', '""') + '"' if any(c in text for c in ',"\n\r') else text


def _text(values: pa.ChunkedArray) -> pa.ChunkedArray:
    """Ids as text: integers in decimal, text trimmed."""
    return pc.utf8_trim_whitespace(values) if pa.types.is_string(values.type) else pc.cast(values, pa.string())


def _integer_like(values: pa.ChunkedArray) -> bool:
    """Whether ids are integers: an integer or whole-float column, or text that reads as int64 and
    back unchanged (007, or an id beyond 64 bits, stays text)."""
    if pa.types.is_integer(values.type):
        return True
    if pa.types.is_floating(values.type):
        return pc.all(pc.equal(pc.floor(values), values)).as_py() is not False
    try:
        return pc.all(pc.equal(pc.cast(pc.cast(_text(values), pa.int64()), pa.string()), _text(values))).as_py()
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return False


def coded_users(table: pa.Table, column: str) -> tuple[pa.Table, pa.Array | None]:
    """The history with text user ids replaced by int64 codes, and the distinct ids to map the codes
    back (None: integer ids, kept as they are). The ids stay on this machine either way."""
    if column not in table.column_names or table[column].null_count or _integer_like(table[column]):
        return table, None  # `keyed` refuses a missing column or an empty id, naming them
    text = _text(table[column])  # trimmed, as ingest trims them
    distinct = pc.unique(text)
    codes = pc.index_in(text, distinct).cast(pa.int64())
    return table.set_column(table.column_names.index(column), column, codes), distinct


def keyed_items(
    table: pa.Table, column: str, keys: pa.Array | None, first: int = 1
) -> tuple[pa.Table, pa.Array | None]:
    """With a catalog of text ids (`keys`, sorted): the table's item column as the model's item ids
    (id i is keys[i - 1]; the j-th distinct id outside the catalog: -j, ignored as any unknown item)
    and those unknown ids in that order; `first` > 1: the column holds new items, numbered from
    `first` instead, and the second value is their ids."""
    if keys is None or column not in table.column_names or table[column].null_count:
        return table, None
    text = _text(table[column])
    if first > 1:
        known = pc.is_in(text, keys)
        if pc.any(known).as_py():
            raise UserError(f"new item {text.filter(known)[0].as_py()!r} is already in the model's catalog")
        ids, named = pa.array(np.arange(first, first + table.num_rows, dtype=np.int64)), text.combine_chunks()
    else:
        ids = pc.add(pc.index_in(text, keys).cast(pa.int64()), 1)
        named = pc.unique(text.filter(pc.is_null(ids)))
        ids = pc.fill_null(ids, pc.negate(pc.add(pc.index_in(text, named).cast(pa.int64()), 1)))
    return table.set_column(table.column_names.index(column), column, ids), named


def own_ids(table: pa.Table, users: pa.Array | None, keys: pa.Array | None, user_col: str, item_col: str) -> pa.Table:
    """Recommendations in the history's own ids and column names."""
    if users is not None:
        table = table.set_column(0, "user_id", pc.take(users, table["user_id"]))
    if keys is not None:
        table = table.set_column(2, "item_id", pc.take(keys, pc.subtract(table["item_id"], 1)))
    return table.rename_columns([user_col, "rank", item_col, *table.column_names[3:]])


def with_label(history: pa.Table, args: argparse.Namespace, settings: dict) -> pa.Table:
    """The history with its rating or count column (--label-col, --count-col) named `label`; for an
    implicit model without one, a note on stderr names the columns left unread (each row counts once)."""
    implicit = settings.get("confidence_alpha") is not None
    if implicit and args.label_col:
        raise UserError(
            "--label-col: this model was trained on implicit feedback (counts): name the column with --count-col"
        )
    if not implicit and args.count_col:
        raise UserError("--count-col: this model was trained on ratings: name the rating column with --label-col")
    column, flag = (args.count_col, "--count-col") if implicit else (args.label_col, "--label-col")
    if column is None:
        unread = [name for name in history.column_names if name not in (args.user_col, args.item_col, "label")]
        if implicit and unread and "label" not in history.column_names:
            LOGGER.warning(
                f"{args.history}: column(s) {', '.join(unread)} not read, each row counts once (a column of counts "
                "is named with --count-col)"
            )
        return history
    if column not in history.column_names:
        raise UserError(
            f"{flag} {column}: {args.history} has no such column (columns: {', '.join(history.column_names)})"
        )
    if "label" in history.column_names and column != "label":
        history = history.drop_columns(["label"])
    return history.rename_columns(["label" if name == column else name for name in history.column_names])


def run(args: argparse.Namespace) -> int:
    if args.out and not args.out.endswith((".csv", ".parquet")):
        raise UserError(f"--out {args.out}: name a .csv or a .parquet file (the format follows the extension)")
    model = PublishedModel.load(args.model)
    history = with_label(read_user_table(args.history, (args.user_col, args.item_col)), args, model.settings)
    history, users = coded_users(history, args.user_col)
    history, unknown = keyed_items(history, args.item_col, model.item_keys)
    history = keyed(history, args.history, {"user_id": args.user_col, "item_id": args.item_col})
    new_items, keys = None, model.item_keys
    if args.new_items:
        new_items = read_user_table(args.new_items, (args.item_col,))
        if keys is not None:
            new_items, added = keyed_items(new_items, args.item_col, keys, first=len(keys) + 1)
            keys = pa.concat_arrays([keys, added]) if added is not None else keys
        new_items = keyed(new_items, args.new_items, {"item_id": args.item_col})
        new_items = _bags_from_csv(new_items, model.settings.get("feature_families") or {})

    def names(items: np.ndarray) -> list:  # ids outside a text catalog as the history wrote them (-j: the j-th)
        return list(items) if unknown is None else [unknown[-int(item) - 1].as_py() for item in items]

    table = model.recommend(history, args.k, not args.include_seen, new_items, source=args.history, names=names)
    table = own_ids(table, users, keys, args.user_col, args.item_col)
    if args.out:
        if args.out.endswith(".csv"):
            sink = io.BytesIO()
            pacsv.write_csv(table, sink)
            storage.StagedFile(sink.getvalue(), args.out).publish()
        else:
            storage.write_table_file(table, args.out)
        print(
            f"wrote {table.num_rows} recommendations for {len(pc.unique(table[args.user_col]))} user(s) to {args.out}"
        )
    else:
        titled = "title" in table.column_names
        sys.stdout.write(
            f"{_csv_field(args.user_col)},rank,{_csv_field(args.item_col)},score" + (",title" if titled else "") + "\n"
        )
        for row in table.to_pylist():
            title = "," + _csv_field(row["title"] or "") if titled else ""
            user, item = (_csv_field(str(row[name])) for name in (args.user_col, args.item_col))
            sys.stdout.write(f"{user},{row['rank']},{item},{row['score']:.6g}{title}\n")
    return 0
