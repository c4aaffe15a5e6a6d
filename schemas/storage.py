"""Reading and atomically writing tables and small JSON documents on local paths or `gs://`.

A table lives at a path ending in `.parquet`, either as one Parquet file or as a folder of
`part-NNNNN.parquet` files (what Spark and this module write). A folder is complete only when its
`_SUCCESS` marker exists: the marker lists the part files and the row count, and readers refuse a
folder without one, so a job that dies mid-write never exposes half a table.

On a local disk a write goes to a hidden temporary sibling folder, renamed into place when complete
(atomic). On object stores (gs://), where a rename is a slow copy, the parts are written into the
folder under names unique to the write, and the commit is the single upload of the marker that lists
them: readers see either the previous complete table or the new one, never a mix. The previous
write's parts are deleted after the commit.

Folders whose file names a library fixes (TensorFlow checkpoints and SavedModels) are written into a
local folder and committed the same way by `write_folder`: renamed into place on a local disk;
uploaded and then marked complete by `_SUCCESS` on gs://. `read_folder` hands such a folder to a
library as a local path (a downloaded copy when it lives on gs://). Libraries thus never need a
gs:// filesystem of their own, and a reader never sees a half-written model.

Privacy: a private folder (`make_private_folder`) and everything written below it are their owner's
alone on a local disk; a seed or registry others can read is refused (`check_private`).
"""

from __future__ import annotations

import json
import math
import os
import posixpath
import shutil
import stat
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress

from schemas.errors import UserError

# gcsfs probes for hierarchical-namespace buckets on every access unless told not to; against the
# storage emulator each probe hangs for about a minute. Set before gcsfs can be imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import fsspec  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.fs as pafs  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

SUCCESS = "_SUCCESS"
DEFAULT_ROWS_PER_FILE = 5_000_000
MAX_FILES_HELD_OPEN = 64  # TableWriter(in_order=...): files kept open for their footer's declaration, at most


class MissingTableError(FileNotFoundError):
    """A table or document that does not exist, or whose write never completed."""


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem serving `path` and the path inside it. A gs:// path's endpoint is
    probed first (`reach_gcs`): gcsfs retries an unreachable host for minutes, with a traceback
    logged at every attempt."""
    if path.startswith("gs://"):
        reach_gcs(path)
    fs, inner = fsspec.core.url_to_fs(path)
    return fs, inner


_REACHED: set[str] = set()


def reach_gcs(path: str) -> None:
    """Refuse a gs:// `path` whose endpoint (storage.googleapis.com, or STORAGE_EMULATOR_HOST) does
    not resolve or answer within SSP_GCS_TIMEOUT seconds (default 10), in one ValueError naming the
    path, the host and the cause; once per host and process. gcsfs's own retry messages are kept
    for -v (pipelines.base.logs)."""
    import socket
    from urllib.parse import urlparse

    endpoint = urlparse(os.environ.get("STORAGE_EMULATOR_HOST") or "https://storage.googleapis.com")
    host, port = endpoint.hostname or "", endpoint.port or (443 if endpoint.scheme == "https" else 80)
    if host in _REACHED:
        return
    try:
        timeout = float(os.environ.get("SSP_GCS_TIMEOUT", "10"))
    except ValueError:
        raise UserError(f"SSP_GCS_TIMEOUT must be a number of seconds, got {os.environ['SSP_GCS_TIMEOUT']!r}") from None
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except socket.gaierror as exc:
        raise UserError(
            f"{path}: cannot reach {host} (DNS: {exc.strerror or exc}); check the network or STORAGE_EMULATOR_HOST"
        ) from None
    except OSError as exc:
        raise UserError(
            f"{path}: cannot reach {host}:{port} within {timeout:g} s ({exc.strerror or exc or 'timed out'}; "
            "SSP_GCS_TIMEOUT sets the wait)"
        ) from None
    _REACHED.add(host)


def join(base: str, *parts: str) -> str:
    """Join path parts with '/', keeping a URL scheme such as gs:// intact."""
    if "://" in base:
        return posixpath.join(base, *parts)
    return os.path.join(base, *parts)


def canonical(path: str) -> str:
    """One spelling of a path, for records that name it (absolute locally; URLs as given)."""
    fs, inner = filesystem(path)
    return os.path.abspath(inner) if is_local(fs) else path.rstrip("/")


def exists(path: str) -> bool:
    """Whether a complete table or a file exists at `path`."""
    fs, inner = filesystem(path)
    fs.invalidate_cache()
    if fs.isdir(inner):
        return fs.exists(posixpath.join(inner, SUCCESS))
    return fs.exists(inner)


def _arrow_fs(fs: fsspec.AbstractFileSystem) -> pafs.FileSystem:
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        return pafs.LocalFileSystem()
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether `fs` is the local disk (atomic renames, file locks)."""
    return isinstance(fs, fsspec.implementations.local.LocalFileSystem)


def encodings(schema: pa.Schema) -> dict:
    """pq.ParquetWriter's options for a table of `schema`: its flat 32- and 64-bit integer columns
    delta-encoded (ids in user and item order, timestamps: small differences, and no dictionary to
    build), the other flat ones dictionary-encoded (labels: a few distinct values), nested ones
    (vectors) plain; a table of numbers alone (flat or lists) uncompressed, since snappy finds little
    to take from delta-packed ids, dictionary indices or random doubles (docs/results.md), one with
    text snappy."""
    integers = [field.name for field in schema if field.type in (pa.int32(), pa.int64())]
    return {
        "use_dictionary": [field.name for field in schema if field.name not in integers],
        "column_encoding": dict.fromkeys(integers, "DELTA_BINARY_PACKED"),
        "compression": "none" if all(_of_numbers(field.type) for field in schema) else "snappy",
    }


def _of_numbers(kind: pa.DataType) -> bool:
    """Whether a column holds numbers, or lists of them."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        return _of_numbers(kind.value_type)
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


class StagedWrite:
    """A table being written as part files, possibly by many processes, published by one commit.

    Holds only strings, so it can be shipped to Spark executors or Beam workers: each task writes
    its part with `write_part(index, table)` (a retried task rewrites the same name), and the
    driver calls `commit(names, rows)` once every part is written, or `abort(names)`.
    """

    def __init__(self, path: str, write_id: str | None = None):
        self.path = path.rstrip("/")
        self.write_id = write_id or uuid.uuid4().hex
        fs, final = filesystem(self.path)
        self.local = is_local(fs)
        if self.local:
            parent, name = posixpath.split(final)
            self.directory, self.suffix = posixpath.join(parent, f".{name}.tmp-{self.write_id}"), ""
        else:
            self.directory, self.suffix = final, f"-{self.write_id}"
        self.final = final

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return filesystem(self.path)[0]

    def part_name(self, index: int) -> str:
        return f"part-{index:05d}{self.suffix}.parquet"

    def open_part(self, index: int, schema: pa.Schema, **parquet_options) -> pq.ParquetWriter:
        """A Parquet writer for part `index` (the caller closes it); options go to pq.ParquetWriter,
        `encodings(schema)` when none are given."""
        fs = self.fs
        _makedirs(self.directory) if self.local else fs.makedirs(self.directory, exist_ok=True)
        return pq.ParquetWriter(
            posixpath.join(self.directory, self.part_name(index)),
            schema,
            filesystem=_arrow_fs(fs),
            **(parquet_options or encodings(schema)),
        )

    def write_part(self, index: int, table: pa.Table, **parquet_options) -> str:
        """Write one whole part; returns its name for `commit`."""
        with self.open_part(index, table.schema, **parquet_options) as writer:
            writer.write_table(table)
        return self.part_name(index)

    def commit(self, names: list[str], rows: int) -> None:
        """Publish the listed parts atomically, replacing any previous table at the path."""
        self.seal(names, rows)
        self.publish()

    def seal(self, names: list[str], rows: int) -> None:
        """Finish the write short of publishing it: on a local disk the marker is written into the
        staging folder, so that `publish` is a rename that needs no space (a full disk cannot stop
        it halfway). On gs:// the marker upload is the publication itself, kept for `publish`."""
        marker = json.dumps({"rows": rows, "files": sorted(names)}).encode()
        if self.local:
            _makedirs(self.directory)
            with open(os.path.join(self.directory, SUCCESS), "wb") as out:
                out.write(marker)
        self._sealed = (sorted(names), marker)

    def publish(self) -> None:
        """Make the sealed write the table at the path, replacing any previous one, and remove
        what earlier killed or failed writes of the same table left behind."""
        names, marker = self._sealed
        fs = self.fs
        if self.local:
            _swap_into_place(self.directory, self.final)
            _clear_stale(self.final)
        else:
            fs.invalidate_cache()
            previous = (
                [f for f in fs.ls(self.final, detail=False) if posixpath.basename(f) not in names]
                if fs.exists(self.final)
                else []
            )
            fs.pipe(posixpath.join(self.final, SUCCESS), marker)
            stale = [f for f in previous if posixpath.basename(f) != SUCCESS]
            if stale:
                fs.rm(stale)
        fs.invalidate_cache()

    def abort(self, names: list[str]) -> None:
        """Discard the listed parts (the whole staging folder on a local disk)."""
        fs = self.fs
        if self.local:
            if fs.exists(self.directory):
                fs.rm(self.directory, recursive=True)
        else:
            mine = [posixpath.join(self.directory, name) for name in names]
            existing = [f for f in mine if fs.exists(f)]
            if existing:
                fs.rm(existing)
        fs.invalidate_cache()


def _run_end(values: np.ndarray, start: int, value) -> int:
    """The first position from `start` on whose value differs from `value` (or the end)."""
    differ = np.flatnonzero(values[start:] != value)
    return start + int(differ[0]) if differ.size else values.size


class TableWriter:
    """Streams record batches into a new table at `path`; nothing is visible until `commit()`.

    Use as a context manager: leaving the block normally commits, an exception discards the
    written files. `rows_per_file` rolls over to a new part file, so huge tables are split into
    files that readers (and Spark) can take in parallel. With `together` (a column), a file rolls
    over only where that column's value changes: rows sharing a value (a user's) stay in one file;
    and when its values came in order, every file gets the key-value metadata `in_order` (a footer
    entry, so the files stay open until the table is sealed; a table of more than
    MAX_FILES_HELD_OPEN files goes without it).
    """

    def __init__(
        self,
        path: str,
        schema: pa.Schema,
        rows_per_file: int = DEFAULT_ROWS_PER_FILE,
        together: str | None = None,
        in_order: dict[bytes, bytes] | None = None,
    ):
        self.path, self.schema, self.rows_per_file, self.together, self.in_order = (
            path.rstrip("/"),
            schema,
            rows_per_file,
            together,
            in_order,
        )
        self._staged = StagedWrite(self.path)
        self._files: list[str] = []
        self._writers: list[pq.ParquetWriter] = []
        self._rows_in_file = 0
        self._last = None  # the `together` value of the last row written
        self._ordered = True  # the `together` values so far never went back
        self.rows = 0
        self._sealed = self._done = False

    @property
    def _writer(self) -> pq.ParquetWriter | None:
        return self._writers[-1] if self._writers else None

    def _open_next_file(self) -> None:
        if (
            len(self._writers) >= MAX_FILES_HELD_OPEN
        ):  # a bound on the writers (and their upload buffers) held open: no declaration then
            self._ordered = False
        if self._writer is not None and not (self.together and self.in_order and self._ordered):
            self._writer.close()
        self._writers.append(self._staged.open_part(len(self._files), self.schema))
        self._files.append(self._staged.part_name(len(self._files)))
        self._rows_in_file = 0

    def write(self, data: pa.RecordBatch | pa.Table) -> None:
        """Append rows; they must already match the writer's schema (columns and types)."""
        if not data.schema.equals(self.schema, check_metadata=False):
            raise UserError(f"{self.path}: batch schema {data.schema} does not match table schema {self.schema}")
        table = data if isinstance(data, pa.Table) else pa.Table.from_batches([data])
        values = table[self.together].to_numpy() if self.together and table.num_rows else None
        if values is not None and self._ordered:
            self._ordered = bool((self._last is None or values[0] >= self._last) and np.all(values[1:] >= values[:-1]))
        start = 0
        while start < table.num_rows or self._writer is None:
            if self._writer is None:
                self._open_next_file()
            room = self.rows_per_file - self._rows_in_file
            if room <= 0 and (values is None or values[start] != self._last):
                self._open_next_file()
                room = self.rows_per_file
            if values is None:
                take = min(table.num_rows - start, room)
            elif room <= 0:  # the file is full but its last value runs on: its rows first
                take = _run_end(values, start, self._last) - start
            else:  # as many rows as fit, and the rest of the value at the cut
                end = min(table.num_rows, start + room)
                take = (_run_end(values, end, values[end - 1]) if end < table.num_rows else end) - start
            if take <= 0:
                break
            self._writer.write_table(table.slice(start, take).replace_schema_metadata(self.schema.metadata))
            if values is not None:
                self._last = values[start + take - 1]
            self._rows_in_file += take
            self.rows += take
            start += take

    def commit(self) -> None:
        """Publish the table atomically, replacing any previous table at the path."""
        if not self._sealed:
            self.seal()
        self._staged.publish()
        self._done = True

    def seal(self) -> None:
        """Write everything short of publishing (see `StagedWrite.seal`); `commit()` then publishes."""
        if self._writer is None:
            self._open_next_file()
        for writer in self._writers:
            if self.together and self.in_order and self._ordered:
                writer.add_key_value_metadata(self.in_order)
            writer.close()  # closing twice does nothing
        self._staged.seal(self._files, self.rows)
        self._sealed = True

    def abort(self) -> None:
        """Discard everything written so far."""
        for writer in self._writers:
            writer.close()
        self._staged.abort(self._files)
        self._done = True

    def __enter__(self) -> TableWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._done:
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def write_table(table: pa.Table, path: str, rows_per_file: int = DEFAULT_ROWS_PER_FILE) -> None:
    """Write a whole table atomically (schema metadata included)."""
    with TableWriter(path, table.schema, rows_per_file) as writer:
        writer.write(table)


def write_table_file(table: pa.Table, path: str) -> None:
    """Write a small table as one Parquet file that replaces any previous one in a single atomic
    step (a temporary file renamed over it locally; one object upload on gs://): a reader, or a
    crash, never finds the path missing or half written. A table folder left at `path` by an older
    write is swapped out first."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    staged = StagedFile(sink.getvalue().to_pybytes(), path)
    fs, inner = filesystem(path)
    if fs.isdir(inner):
        shutil.rmtree(inner) if is_local(fs) else fs.rm(inner, recursive=True)
    staged.publish()


class StagedFile:
    """A small file written in full beside its path, then published in one step: a rename on a
    local disk (which needs no space, so a full disk fails the write, never the publication), a
    single object upload on gs://. A failed write leaves nothing behind."""

    def __init__(self, payload: bytes, path: str):
        self.path, self.payload = path, payload
        fs, self.inner = filesystem(path)
        self.local = is_local(fs)
        if self.local:
            _makedirs(os.path.dirname(self.inner) or ".")
            self.tmp = f"{self.inner}.tmp-{uuid.uuid4().hex}"
            try:
                with open(self.tmp, "wb") as out:
                    out.write(payload)
                    out.flush()
                    os.fsync(out.fileno())
            except BaseException:
                self.abort()
                raise

    def publish(self) -> None:
        fs = filesystem(self.path)[0]
        if self.local:
            _inherit_privacy(self.tmp, os.path.dirname(self.inner) or ".")
            os.replace(self.tmp, self.inner)
            _clear_stale(self.inner)
        else:
            fs.pipe(self.inner, self.payload)
        fs.invalidate_cache()

    def abort(self) -> None:
        if self.local and os.path.lexists(self.tmp):
            os.remove(self.tmp)


def _clear_stale(final: str) -> None:
    """Remove what killed or failed writes of the local path `final` left beside it: hidden
    staging folders `.NAME.tmp-*` (tables, model folders) and temporary files `NAME.tmp-*`.
    Called after a write of `final` is published: writes of one path are serialised by the run or
    release lock, so whatever staging of it remains belongs to a write that will never finish."""
    parent, name = os.path.split(final)
    try:
        entries = os.listdir(parent or ".")
    except OSError:
        return
    for entry in entries:
        if entry.startswith((f".{name}.tmp-", f"{name}.tmp-")):
            stale = os.path.join(parent, entry)
            if os.path.isdir(stale) and not os.path.islink(stale):
                shutil.rmtree(stale, ignore_errors=True)
            else:
                with suppress(OSError):
                    os.remove(stale)


def _swap_into_place(staging: str, final: str) -> None:
    """Rename the local folder `staging` to `final`, replacing any folder there (local disk only)."""
    old = None
    if os.path.lexists(final):
        old = f"{staging}.old"
        os.rename(final, old)
    _makedirs(os.path.dirname(final) or ".")
    _inherit_privacy(staging, os.path.dirname(final) or ".")
    os.rename(staging, final)
    if old:
        shutil.rmtree(old)


PRIVATE_FOLDER, PRIVATE_FILE = 0o700, 0o600
PRIVATE_MARK = ".ssp-private"  # in a folder `make_private_folder` made: what is written below it is private


def _is_private(mode: int) -> bool:
    return not mode & 0o077


def _in_private_folder(local: str) -> bool:
    """Whether the local folder `local` is, or lies below, a folder `make_private_folder` made."""
    folder = os.path.abspath(local)
    while True:
        if os.path.exists(os.path.join(folder, PRIVATE_MARK)):
            return True
        parent = os.path.dirname(folder)
        if parent == folder:
            return False
        folder = parent


def _makedirs(local: str) -> None:
    """os.makedirs of the local folder `local`; the folders it creates below a private folder are
    private too (0700), whatever the umask."""
    missing, existing = [], os.path.abspath(local)
    while not os.path.isdir(existing):
        missing.append(existing)
        existing = os.path.dirname(existing)
    os.makedirs(local, exist_ok=True)
    if missing and _in_private_folder(existing):
        for folder in missing:
            os.chmod(folder, PRIVATE_FOLDER)


def _inherit_privacy(local: str, parent: str) -> None:
    """Make the local file or folder tree `local`, about to be placed in the folder `parent`, its
    owner's alone (folders 0700, files 0600) when `parent` is a private folder or lies below one:
    what a private folder holds stays private whatever the umask and whoever wrote it (this
    process, Spark's workers, TensorFlow)."""
    if not _in_private_folder(parent):
        return
    if os.path.isdir(local) and not os.path.islink(local):
        for top, _, files in os.walk(local):
            os.chmod(top, PRIVATE_FOLDER)
            for name in files:
                os.chmod(os.path.join(top, name), PRIVATE_FILE)
    else:
        os.chmod(local, PRIVATE_FILE)


def make_private_folder(path: str) -> None:
    """Make the folder `path` (and its missing parents), or an existing one, private: enterable by
    its owner alone (0700 whatever the umask), and so is everything written below it from then on
    (marked by a PRIVATE_MARK file in it); what it holds already is made 0700 / 0600 too. On gs://
    nothing: the bucket's access policy decides who reads it (docs/privacy.md)."""
    fs, inner = filesystem(path)
    if not is_local(fs):
        return
    os.makedirs(inner, mode=PRIVATE_FOLDER, exist_ok=True)  # private from its creation: never seen open
    if os.path.exists(os.path.join(inner, PRIVATE_MARK)):  # made private before: all since inherited it
        os.chmod(inner, PRIVATE_FOLDER)
        return
    with open(os.path.join(inner, PRIVATE_MARK), "a"):
        pass
    _inherit_privacy(inner, inner)


def check_private(path: str, what: str) -> None:
    """Refuse the local file or folder `path` (`what` it is, for the message) when its group or others
    may read it, as ssh refuses a private key that others can read; gs:// paths are the bucket's."""
    fs, inner = filesystem(path)
    if not is_local(fs) or not os.path.exists(inner):
        return
    mode = stat.S_IMODE(os.stat(inner).st_mode)
    if not _is_private(mode):
        fix = "700" if os.path.isdir(inner) else "600"
        raise UserError(
            f"{path}: {what} can be read by others (mode {mode:04o}); only its owner may read it: chmod {fix} {inner}"
        )


def _folder_marker(local: str) -> tuple[list[str], bytes]:
    """The relative names of the files under the local folder `local`, and its `_SUCCESS` marker."""
    names = sorted(
        posixpath.relpath(os.path.join(top, name), local).replace(os.sep, "/")
        for top, _, files in os.walk(local)
        for name in files
    )
    return names, json.dumps({"files": names}).encode()


@contextmanager
def write_folder(path: str) -> Iterator[str]:
    """A local folder to fill (e.g. with a TensorFlow checkpoint or SavedModel) that becomes the
    folder at `path` when the block ends without an exception, replacing any previous one.

    Local `path`: the block writes a hidden sibling folder that is renamed into place. gs://: it
    writes a local temporary folder; the previous marker is removed first (the folder reads as
    incomplete from then on, never as a mix of two versions), the files are uploaded, stale files
    of the previous version deleted, and the `_SUCCESS` marker listing the files is uploaded last.
    """
    fs, final = filesystem(path.rstrip("/"))
    if is_local(fs):
        parent, name = os.path.split(final)
        staging = os.path.join(parent, f".{name}.tmp-{uuid.uuid4().hex}")
        _makedirs(staging)
        try:
            yield staging
            names, marker = _folder_marker(staging)
            with open(os.path.join(staging, SUCCESS), "wb") as out:
                out.write(marker)
            _swap_into_place(staging, final)
            _clear_stale(final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return
    staging = tempfile.mkdtemp(prefix="ssp-folder-")
    try:
        yield staging
        names, marker = _folder_marker(staging)
        fs.invalidate_cache()
        previous = [posixpath.relpath(f, final) for f in fs.find(final)] if fs.exists(final) else []
        if SUCCESS in previous:
            fs.rm_file(posixpath.join(final, SUCCESS))
        for name in names:
            fs.put_file(os.path.join(staging, name), posixpath.join(final, name))
        stale = [posixpath.join(final, name) for name in previous if name not in names and name != SUCCESS]
        if stale:
            fs.rm(stale)
        fs.pipe(posixpath.join(final, SUCCESS), marker)
        fs.invalidate_cache()
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@contextmanager
def read_folder(path: str) -> Iterator[str]:
    """The folder committed at `path` by `write_folder`, as a local path for the block: the folder
    itself on a local disk, a temporary downloaded copy of its listed files on gs://."""
    fs, inner = filesystem(path.rstrip("/"))
    marker = posixpath.join(inner, SUCCESS)
    fs.invalidate_cache()
    if not fs.exists(marker):
        raise MissingTableError(f"{path} is missing or incomplete: no {SUCCESS} marker (its write did not finish)")
    if is_local(fs):
        yield inner
        return
    names = _read_marker(fs, marker, path).get("files", [])
    staging = tempfile.mkdtemp(prefix="ssp-folder-")
    try:
        for name in names:
            os.makedirs(os.path.dirname(os.path.join(staging, name)), exist_ok=True)
            fs.get_file(posixpath.join(inner, name), os.path.join(staging, name))
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def download_table(path: str, folder: str) -> list[str]:
    """Copy the data files of the committed table at `path` into the local `folder`; returns their
    local paths (for engines that cannot read its filesystem)."""
    fs, files = _table_files(path)
    os.makedirs(folder, exist_ok=True)
    local = [os.path.join(folder, posixpath.basename(f)) for f in files]
    for remote, target in zip(files, local, strict=True):
        fs.get_file(remote, target)
    return local


def _table_files(path: str) -> tuple[fsspec.AbstractFileSystem, list[str]]:
    fs, inner = filesystem(path)
    fs.invalidate_cache()
    if fs.isfile(inner):
        return fs, [inner]
    if not fs.isdir(inner):
        raise MissingTableError(f"table not found: {path}")
    marker = posixpath.join(inner, SUCCESS)
    if not fs.exists(marker):
        raise MissingTableError(f"table {path} is incomplete: no {SUCCESS} marker (its write did not finish)")
    present = {posixpath.basename(f) for f in fs.ls(inner, detail=False)}
    files = _read_marker(fs, marker, path).get("files")
    if files is None:  # a marker written by another engine (Spark writes an empty one)
        files = sorted(name for name in present if name.endswith(".parquet"))
    missing = [name for name in files if name not in present]
    if missing:
        raise MissingTableError(
            f"table {path} is damaged: its {SUCCESS} marker lists {missing[0]}, which is missing"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    return fs, [posixpath.join(inner, name) for name in files]


def _read_marker(fs: fsspec.AbstractFileSystem, marker: str, path: str) -> dict:
    """The `_SUCCESS` marker of the table or folder at `path` (empty when written by another engine)."""
    try:
        document = json.loads(fs.cat_file(marker) or b"{}")
        if not isinstance(document, dict) or not isinstance(document.get("files", []), list):
            raise UserError("not a JSON object with a list of files")
    except (ValueError, UnicodeDecodeError) as exc:
        raise MissingTableError(
            f"{path} is damaged: its {SUCCESS} marker is not the list of its files ({exc})"
        ) from None
    return document


def table_files(path: str) -> list[str]:
    """The data files of a committed table, as full paths or URLs (for engines that read them)."""
    fs, files = _table_files(path)
    return [_url(fs, f) for f in files]


def _url(fs: fsspec.AbstractFileSystem, inner: str) -> str:
    """A filesystem's path as a URL (local paths stay paths)."""
    protocol = fs.protocol[0] if isinstance(fs.protocol, (tuple, list)) else fs.protocol
    return inner if protocol in ("file", "local") else f"{protocol}://{inner}"


class DamagedTableError(UserError):
    """A data file that exists but cannot be read as Parquet (truncated, overwritten, not Parquet)."""


@contextmanager
def _reading(file: str) -> Iterator[None]:
    """Name the data file in the error when Arrow cannot read it (its own message names none)."""
    try:
        yield
    except (pa.ArrowInvalid, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise DamagedTableError(f"{file} cannot be read as Parquet: {exc}".rstrip()) from None


def file_metadata(file: str) -> dict[bytes, bytes]:
    """The key-value metadata of one data file's Parquet footer (the schema's metadata among it)."""
    fs, inner = filesystem(file)
    with _reading(file), _arrow_fs(fs).open_input_file(inner) as handle:
        return dict(pq.ParquetFile(handle).metadata.metadata or {})


def read_schema(path: str) -> pa.Schema:
    """The schema (with its metadata) of the table at `path`."""
    fs, files = _table_files(path)
    with _reading(files[0]):
        return pq.read_schema(files[0], filesystem=_arrow_fs(fs))


def read_table(path: str, columns: list[str] | None = None) -> pa.Table:
    """Read a whole table (a Parquet file or a committed folder), keeping its schema metadata."""
    fs, files = _table_files(path)
    arrow_fs = _arrow_fs(fs)
    parts = []
    for f in files:
        with _reading(f):
            parts.append(pq.read_table(f, columns=columns, filesystem=arrow_fs))
    schema = parts[0].schema
    return pa.concat_tables([part.replace_schema_metadata(schema.metadata) for part in parts])


def read_ahead(items: Iterable) -> Iterator:
    """The items of an iterable, each next one produced in a thread while the caller works on the
    last (Parquet's reads and numpy release the GIL)."""
    iterator, done = iter(items), object()
    with ThreadPoolExecutor(max_workers=1) as pool:
        upcoming = pool.submit(next, iterator, done)
        while (item := upcoming.result()) is not done:
            upcoming = pool.submit(next, iterator, done)
            yield item


def iter_batches(path: str, columns: list[str] | None = None, batch_size: int = 65_536) -> Iterator[pa.RecordBatch]:
    """Stream a table's rows in record batches: memory stays bounded by the batch size (column
    chunks are read in 1 MiB buffers, not whole row groups at a time)."""
    fs, files = _table_files(path)
    arrow_fs = _arrow_fs(fs)
    for f in files:
        with _reading(f), arrow_fs.open_input_file(f) as handle:
            yield from pq.ParquetFile(handle, pre_buffer=False, buffer_size=1 << 20).iter_batches(
                batch_size=batch_size, columns=columns
            )


def row_count(path: str) -> int:
    """The rows of a committed table, from its files' footers (no rows read)."""
    return sum(rows for _, _, rows in row_groups(path))


def _row_group_ranges(metadata: pq.FileMetaData, column: str) -> list[tuple[int, int] | None]:
    """(smallest, largest) value of the integer `column` in each row group of a data file, from its
    Parquet statistics; None for a row group without them."""
    leaf = next(i for i in range(metadata.num_columns) if metadata.schema.column(i).path == column)
    ranges = []
    for group in range(metadata.num_row_groups):
        stats = metadata.row_group(group).column(leaf).statistics
        ranges.append((int(stats.min), int(stats.max)) if stats is not None and stats.has_min_max else None)
    return ranges


def iter_batches_holding(
    path: str, column: str, values: np.ndarray, columns: list[str] | None = None, batch_size: int = 65_536
) -> Iterator[pa.RecordBatch]:
    """`iter_batches` of the row groups that may hold one of `values` in the integer `column`, as
    their Parquet statistics tell (a row group without them is read): a few ids' rows without
    reading the whole table. The batches hold other rows too; the caller filters them."""
    wanted = np.asarray(values, dtype=np.int64)
    fs, files = _table_files(path)
    arrow_fs = _arrow_fs(fs)
    for f in files:
        with _reading(f), arrow_fs.open_input_file(f) as handle:
            parquet = pq.ParquetFile(handle, pre_buffer=False, buffer_size=1 << 20)
            groups = [
                group
                for group, extent in enumerate(_row_group_ranges(parquet.metadata, column))
                if extent is None or np.any((wanted >= extent[0]) & (wanted <= extent[1]))
            ]
            if groups:
                yield from parquet.iter_batches(batch_size=batch_size, row_groups=groups, columns=columns)


def row_groups(path: str) -> list[tuple[str, int, int]]:
    """(file, row group, rows) of every row group of a committed table, in order, the files as
    `table_files` gives them: work units for engines whose tasks read a table themselves."""
    fs, files = _table_files(path)
    arrow_fs = _arrow_fs(fs)
    units = []
    for inner in files:
        with _reading(inner), arrow_fs.open_input_file(inner) as handle:
            metadata = pq.ParquetFile(handle).metadata
        units += [
            (_url(fs, inner), group, metadata.row_group(group).num_rows) for group in range(metadata.num_row_groups)
        ]
    return units


def value_range(file: str, column: str) -> tuple[int, int] | None:
    """(smallest, largest) value of an integer column of one data file, from its row groups'
    Parquet statistics (no rows read); None when a row group has no statistics for it."""
    fs, inner = filesystem(file)
    with _reading(file), _arrow_fs(fs).open_input_file(inner) as handle:
        ranges = _row_group_ranges(pq.ParquetFile(handle).metadata, column)
    if not ranges or None in ranges:
        return None
    return min(low for low, _ in ranges), max(high for _, high in ranges)


def iter_row_group(
    file: str, group: int, columns: list[str] | None = None, batch_size: int = 65_536
) -> Iterator[pa.RecordBatch]:
    """Stream one row group of a data file (from `row_groups`) in record batches."""
    fs, inner = filesystem(file)
    with _reading(file), _arrow_fs(fs).open_input_file(inner) as handle:
        yield from pq.ParquetFile(handle, pre_buffer=False, buffer_size=1 << 20).iter_batches(
            batch_size=batch_size, row_groups=[group], columns=columns
        )


def _json_ready(value):
    """Standard JSON has no infinity or NaN: such floats become the strings "inf", "-inf", "nan"
    (float() reads them back); numpy scalars become Python numbers."""
    if hasattr(value, "item") and not isinstance(value, (list, dict, str)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def write_json(document: dict, path: str, *, private: bool = False) -> None:
    """Write a small JSON document atomically (temporary file, then rename or single put); a
    `private` one readable by its owner alone (0600) wherever it is."""
    staged = StagedFile(json_payload(document), path)
    if private and staged.local:
        os.chmod(staged.tmp, PRIVATE_FILE)
    staged.publish()


def create_json(document: dict, path: str, *, private: bool = False) -> bool:
    """Write a small JSON document only where none is yet, in one atomic step (a hard link on a
    local disk, an upload with generation precondition 0 on gs://): True if this call created it,
    False if one was there. Of two writers exactly one creates it, whatever became of their locks."""
    payload = json_payload(document)
    fs, inner = filesystem(path)
    try:
        if is_local(fs):
            staged = StagedFile(payload, path)
            try:
                if private:
                    os.chmod(staged.tmp, PRIVATE_FILE)
                _inherit_privacy(staged.tmp, os.path.dirname(inner) or ".")
                os.link(staged.tmp, inner)
            except FileExistsError:
                return False
            finally:
                staged.abort()
            return True
        from google.api_core import exceptions
        from google.cloud import storage as gcs

        bucket, _, name = inner.partition("/")
        try:
            gcs.Client(project=None).bucket(bucket).blob(name).upload_from_string(
                payload, content_type="application/json", if_generation_match=0
            )
        except exceptions.PreconditionFailed:
            return False
        return True
    finally:
        fs.invalidate_cache()


def json_payload(document: dict) -> bytes:
    """The bytes `write_json` writes for `document`."""
    return json.dumps(_json_ready(document), indent=2, sort_keys=True, allow_nan=False).encode() + b"\n"


def require_folder_target(path: str, flag: str) -> None:
    """Refuse an output folder `path` (given as `flag`) that is an existing file, before anything is
    written: the write would otherwise fail halfway with the operating system's words."""
    fs, inner = filesystem(path)
    fs.invalidate_cache()
    if fs.isfile(inner):
        raise UserError(f"{flag} {path} is a file; give a folder (new or written by ssp)")


def remove(path: str) -> None:
    """Delete a file or table folder if it exists."""
    fs, inner = filesystem(path)
    fs.invalidate_cache()
    if fs.exists(inner):
        fs.rm(inner, recursive=True)
    fs.invalidate_cache()


def read_json(path: str) -> dict:
    """Read a JSON document written by `write_json`."""
    fs, inner = filesystem(path)
    fs.invalidate_cache()
    if not fs.isfile(inner):
        raise MissingTableError(f"file not found: {path}")
    try:
        return json.loads(fs.cat_file(inner))
    except (ValueError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not a JSON document ({exc})") from None
