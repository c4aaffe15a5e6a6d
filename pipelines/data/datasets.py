"""The canonical data set folder: `interactions.parquet`, `items.parquet` and `manifest.json`.

`ssp ingest` and `ssp synth` write this layout, and every later command reads it (or ingests a
MovieLens folder into it first). The manifest is written last and marks the folder complete; it
records the source, which feature families were declared public, and the table sizes.

Privacy: the interactions table is private; it stays inside the run's trusted storage.
"""

from __future__ import annotations

import datetime
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.data.chunks import USERS_TOGETHER
from schemas import storage
from schemas.errors import UserError
from schemas.tables import INTERACTIONS, item_features, validate_interactions, validate_items

INTERACTIONS_TABLE = "interactions.parquet"
ITEMS_TABLE = "items.parquet"
ITEM_KEYS_TABLE = "item_keys.parquet"  # a catalog with text ids: (item_id, item_key), public as the catalog
ITEM_KEYS = pa.schema([("item_id", pa.int64()), ("item_key", pa.string())])
USER_KEYS_TABLE = "user_keys.parquet"  # (user_id, user_key) of the users whose text ids were hashed: PRIVATE
USER_KEYS = pa.schema([("user_id", pa.int64()), ("user_key", pa.string())])
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Dataset:
    """A committed canonical data set folder."""

    path: str
    manifest: dict

    @property
    def interactions(self) -> str:
        return storage.join(self.path, INTERACTIONS_TABLE)

    @property
    def items(self) -> str:
        return storage.join(self.path, ITEMS_TABLE)

    @property
    def user_keys(self) -> str | None:
        """The private (user_id, user_key) table of the users whose text ids were hashed; None if none were."""
        return storage.join(self.path, USER_KEYS_TABLE) if self.manifest.get("ids", {}).get("user") == "text" else None

    @property
    def item_keys(self) -> str | None:
        """The (item_id, item_key) table of a catalog whose ids are text; None for integer ids."""
        return storage.join(self.path, ITEM_KEYS_TABLE) if self.manifest.get("ids", {}).get("item") == "text" else None


def is_dataset(path: str) -> bool:
    """Whether `path` holds a complete canonical data set."""
    return storage.exists(storage.join(path, MANIFEST))


def open_dataset(path: str) -> Dataset:
    """Open a canonical data set folder, refusing one whose write never finished."""
    if not is_dataset(path):
        raise storage.MissingTableError(
            f"{path} is not a data set folder (no {MANIFEST}); give a MovieLens folder to `ssp ingest` "
            "or a folder written by `ssp ingest` / `ssp synth`"
        )
    return Dataset(path, storage.read_json(storage.join(path, MANIFEST)))


class _InteractionStats:
    """Running counts over streamed interaction batches: rows, distinct users and items, label range."""

    def __init__(self) -> None:
        self.rows = 0
        self.users = np.empty(0, np.int64)
        self.items = np.empty(0, np.int64)
        self.label_min, self.label_max = np.inf, -np.inf

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self.rows += batch.num_rows
        self.users = np.union1d(self.users, np.unique(batch.column("user_id").to_numpy()))
        self.items = np.union1d(self.items, np.unique(batch.column("item_id").to_numpy()))
        labels = batch.column("label").to_numpy()
        self.label_min = min(self.label_min, float(labels.min()))
        self.label_max = max(self.label_max, float(labels.max()))

    def summary(self) -> dict:
        return {
            "ratings": self.rows,
            "users": int(self.users.size),
            "rated_items": int(self.items.size),
            "label_range": [self.label_min, self.label_max] if self.rows else None,
        }


def require_dataset_target(out: str) -> None:
    """Refuse an `--out` that holds something other than a data set (a training run, a publication,
    any other files): a data set written there would mix the private log into it, or replace its
    manifest. A missing or empty folder, or an earlier data set (replaced whole), is fine."""
    storage.require_folder_target(out, "--out")
    fs, folder = storage.filesystem(out)
    if not fs.exists(folder) or not fs.ls(folder):
        return
    manifest = storage.join(out, MANIFEST)
    if storage.exists(manifest):
        if {"ratings", "public_features"} <= set(storage.read_json(manifest)):  # a data set's (a run's has "config")
            return
    elif all(
        name in (ITEMS_TABLE, INTERACTIONS_TABLE, ITEM_KEYS_TABLE, USER_KEYS_TABLE, storage.PRIVATE_MARK)
        or ".tmp-" in name
        for name in (posixpath.basename(path.rstrip("/")) for path in fs.ls(folder))
    ):
        # a data set's write that was killed: its private mark, tables or staging, no manifest yet (the next
        # write replaces it)
        return
    raise UserError(
        f"--out {out} holds something other than a data set (a run, a publication or other files); use a new --out"
    )


def write_dataset(
    out: str,
    items: pa.Table,
    interaction_batches: Iterable[pa.RecordBatch],
    manifest: dict,
    item_keys: pa.Table | None = None,
) -> Dataset:
    """Validate and write a data set: items (and the `item_keys` of a catalog with text ids),
    streamed interactions, then the manifest.

    Interactions are validated batch by batch and must refer to catalog items only. No file splits
    a user's consecutive rows; when the rows came in user_id order (synth's, MovieLens' ratings
    files), every file says it holds whole users in order (chunks.USERS_TOGETHER): a user-local step
    (the split) then takes a file per task with no shuffle by user. A data set
    already in `out` stays whole until the new one is written in full: both tables and the new
    manifest are staged beside it first, and only then swapped in (on a local disk by renames,
    which need no space, so a full disk or a bad row leaves the earlier data set as it was). The
    old manifest goes first and the new one lands last: a folder caught between the two reads as
    incomplete, never as a mix.
    """
    require_dataset_target(out)
    fs, folder = storage.filesystem(out)
    created = storage.is_local(fs) and not fs.exists(folder)  # removed again if this write fails
    storage.make_private_folder(out)  # it holds the private interactions: its owner's alone
    items = validate_items(items).sort_by("item_id")  # canonical: every join and lookup may rely on the order
    catalog = items["item_id"].to_numpy()
    stats = _InteractionStats()
    interactions = storage.TableWriter(
        storage.join(out, INTERACTIONS_TABLE), INTERACTIONS, together="user_id", in_order=USERS_TOGETHER
    )
    item_table = storage.TableWriter(storage.join(out, ITEMS_TABLE), items.schema)
    key_table = storage.TableWriter(storage.join(out, ITEM_KEYS_TABLE), ITEM_KEYS) if item_keys is not None else None
    user_table = None  # made by the first batch that carries hashed users' own ids
    try:
        for batch in interaction_batches:
            table = pa.Table.from_batches([batch])
            if "user_key" in table.column_names:  # the batch's hashed users' own ids, each once
                named = table.select(["user_id", "user_key"]).filter(pc.is_valid(table["user_key"]))
                if user_table is None:
                    user_table = storage.TableWriter(storage.join(out, USER_KEYS_TABLE), USER_KEYS)
                user_table.write(named.group_by(["user_id", "user_key"]).aggregate([]).cast(USER_KEYS))
                table = table.drop_columns(["user_key"])
            table = validate_interactions(table)
            ids = table["item_id"].to_numpy()
            unknown = ids[~np.isin(ids, catalog)]
            if unknown.size:
                raise UserError(
                    f"interactions refer to {np.unique(unknown).size} item(s) missing from the catalog, "
                    f"e.g. {unknown[0]}"
                )
            for part in table.to_batches():
                stats.add(part)
            interactions.write(table)
        interactions.seal()
        item_table.write(items)
        item_table.seal()
        if key_table is not None:
            key_table.write(item_keys.select(ITEM_KEYS.names).cast(ITEM_KEYS).sort_by("item_id"))
            key_table.seal()
        if user_table is not None:
            user_table.seal()
        full_manifest = {
            **manifest,
            "public_features": item_features(items.schema),
            "items": items.num_rows,
            **stats.summary(),
            "created_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        staged_manifest = storage.StagedFile(storage.json_payload(full_manifest), storage.join(out, MANIFEST))
    except BaseException:
        interactions.abort()
        item_table.abort()
        if key_table is not None:
            key_table.abort()
        if user_table is not None:
            user_table.abort()
        left = {posixpath.basename(path) for path in fs.ls(folder, detail=False)} if fs.isdir(folder) else None
        if created and left is not None and left <= {storage.PRIVATE_MARK}:
            fs.rm(folder, recursive=True)  # a failed write leaves no new folder behind
        raise
    storage.remove(storage.join(out, MANIFEST))  # the folder is incomplete until the new manifest lands
    interactions.commit()
    item_table.commit()
    for writer, name in ((key_table, ITEM_KEYS_TABLE), (user_table, USER_KEYS_TABLE)):
        if writer is not None:
            writer.commit()
        else:
            storage.remove(storage.join(out, name))  # an earlier data set's keys in this folder
    staged_manifest.publish()
    return Dataset(out, full_manifest)
