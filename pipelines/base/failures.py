"""Which failures are the user's to fix, and the one line that says so.

Bad input, bad settings (schemas.errors.UserError, the project's refusals) and the environment (a
missing or damaged file, an output path that is a file, a full or read-only disk, a file-size
limit) end a command with one line naming the file or setting and exit status 2; anything else is
a bug, whatever its class (a ValueError of numpy or pyarrow included). A failure inside a Spark
task reaches the driver wrapped in Java and Py4J errors whose text is pages of stack traces: its
root cause is found and judged the same way.

Privacy: the lines and saved tracebacks go to the operator on the trusted side, who may see private
rows in them; nothing here is released.
"""

from __future__ import annotations

import os
import re
import tempfile

# Python exceptions raised inside Spark's Python workers arrive as text: judged by their class name.
REFUSAL_NAMES = (
    "UserError",
    "SchemaError",
    "IngestError",
    "DamagedTableError",
)  # the project's refusals a task raises (schemas.errors.UserError)
USER_ERROR_NAMES = (
    *REFUSAL_NAMES,
    "MissingTableError",
    "FileNotFoundError",
    "PermissionError",
    "IsADirectoryError",
    "NotADirectoryError",
    "FileExistsError",
    "OSError",
    "IOError",
    "ArrowInvalid",
)
# Java failures of the job's input or output: Spark's error classes, and I/O exceptions by package.
SPARK_USER_ERROR_CLASSES = ("FAILED_READ_FILE", "PATH_NOT_FOUND", "TASK_WRITE_FAILED", "UNABLE_TO_INFER_SCHEMA")
JAVA_USER_ERROR_PACKAGES = ("java.io.", "java.nio.file.", "org.apache.hadoop.fs.", "org.apache.parquet.io.")
# TensorFlow reports its own file I/O failures (checkpoints, SavedModels) as op errors carrying these.
DISK_REASONS = (
    "No space left on device",
    "Read-only file system",
    "File too large",
    "Permission denied",
    "Disk quota exceeded",
)
_LAST_PYTHON_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+): (.+)$")


def one_line(exc: BaseException, user_errors: tuple[type, ...], output: str | None = None) -> str | None:
    """The message of a failure the user can act on, on one line; None for a bug. `output` is
    where the command writes, named when a disk error does not say which file it hit."""
    if isinstance(exc, user_errors):
        return _flat(str(exc))
    if isinstance(exc, OSError):
        return _os_error(exc, output)
    package = type(exc).__module__.split(".")[0]
    if package in ("py4j", "pyspark"):
        return _spark_cause(exc, output)
    if package == "tensorflow" and any(reason in str(exc) for reason in DISK_REASONS):
        return _flat(
            re.sub(r"\{\{function_node [^}]*\}\}\s*|\s*\[Op:\w+\]", "", str(exc))
        )  # TensorFlow's file I/O: "path; reason"
    return None


def _flat(message: str) -> str:
    return " ".join(line.strip() for line in message.strip().splitlines() if line.strip())


def _os_error(exc: OSError, output: str | None) -> str:
    what = exc.strerror or _flat(str(exc)) or type(exc).__name__
    if exc.filename is not None:
        where = f"{exc.filename}" + (f" -> {exc.filename2}" if exc.filename2 is not None else "")
        return f"{where}: {what}"
    return f"{what} (writing under {output})" if output else what


def _spark_cause(exc: BaseException, output: str | None) -> str | None:
    """The one line of a failed Spark job: a Python worker's user error, or a Java input/output error
    (missing or truncated file, full disk, file-size limit), by its own message; any other failure
    inside the JVM by its root cause, the full trace saved to a log file. None for a bug of ours: a
    Python worker's other exceptions, and errors raised before any job ran (a query that is wrong)."""
    texts, chain = _java_chain(exc)
    worker = _worker_error(texts)
    if worker is not None:
        return worker[1] if worker[0] in USER_ERROR_NAMES else None
    for throwable in chain:
        name, error_class = str(throwable.getClass().getName()), _error_class(throwable)
        if error_class.startswith(SPARK_USER_ERROR_CLASSES) or name.startswith(JAVA_USER_ERROR_PACKAGES):
            message = str(throwable.getMessage() or name).strip().splitlines()[0]
            return f"{message} (writing under {output})" if output and "space" in message.lower() else message
    if not chain:
        return None
    # A failure inside Spark's JVM that no Python code of ours raised: the machine's (memory, disk,
    # native libraries), not something a Java stack helps the user with. One line, the stack kept.
    root = chain[-1]
    message = _flat(str(root.getMessage() or "")) or "no message"
    return f"the Spark job failed: {root.getClass().getName()}: {message[:500]} (full trace: {save_trace(texts)})"


def _java_chain(exc: BaseException) -> tuple[list[str], list]:
    """(texts of the exception and of its Java cause chain, the chain's throwables, outermost first)."""
    texts = [str(exc)]
    java = getattr(exc, "java_exception", None)
    chain = []
    while java is not None:
        chain.append(java)
        texts.append(str(java.toString()))
        cause = java.getCause()
        java = cause if cause is not None and not cause.equals(java) else None
    return texts, chain


def _worker_error(texts: list[str]) -> tuple[str, str] | None:
    """(class name, message) of a Python worker's exception: its traceback's last line."""
    for text in texts:
        if "Traceback (most recent call last)" in text:
            tail = text[text.rindex("Traceback (most recent call last)") :]
            for line in reversed(tail.splitlines()):
                match = _LAST_PYTHON_LINE.match(line.strip())
                if match:
                    return match.group(1), match.group(2)
    return None


def task_refusal(exc: BaseException) -> str | None:
    """The message of a refusal (a UserError: a row the job refuses) that a Spark job's Python task
    raised, as the driver receives it wrapped in Spark's errors; None for anything else."""
    if type(exc).__module__.split(".")[0] not in ("py4j", "pyspark"):
        return None
    worker = _worker_error(_java_chain(exc)[0])
    return worker[1] if worker is not None and worker[0] in REFUSAL_NAMES else None


def save_trace(texts: list[str]) -> str:
    """Write a failure's full text to a temporary log file for a bug report; returns its path."""
    try:
        handle, path = tempfile.mkstemp(prefix="ssp-error-", suffix=".log")
        with os.fdopen(handle, "w") as log:
            log.write("\n\n".join(texts))
        return path
    except OSError as exc:  # the disk that failed the job may not take the log either
        return f"not saved: {exc.strerror}"


def _error_class(throwable) -> str:
    """Spark's error class of a Java throwable ("" for throwables that are not Spark's)."""
    try:
        return str(throwable.getErrorClass() or "")
    except Exception:  # a plain Java exception has no such method
        return ""
