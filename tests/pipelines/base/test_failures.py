"""Which failures the CLI reports in one line (pipelines.base.failures), on hand-made exceptions."""

import errno

import pytest

from pipelines.base import failures
from pipelines.data.movielens import IngestError

USER = (IngestError, ValueError)


def test_a_user_error_is_its_message_on_one_line():
    assert failures.one_line(IngestError("movies.csv, line 3:\n  bad\n"), USER) == "movies.csv, line 3: bad"


@pytest.mark.parametrize(
    "exc, output, expected",
    [
        (OSError(errno.EROFS, "Read-only file system", "/data/ds"), None, "/data/ds: Read-only file system"),
        (
            OSError(errno.EXDEV, "Invalid cross-device link", "/a", None, "/b"),
            None,
            "/a -> /b: Invalid cross-device link",
        ),
        (
            OSError(errno.ENOSPC, "No space left on device"),
            "/runs/r",
            "No space left on device (writing under /runs/r)",
        ),
        (
            OSError("Error writing bytes to file. Detail: [errno 27] File too large"),
            None,
            "Error writing bytes to file. Detail: [errno 27] File too large",
        ),
    ],
    ids=["named file", "two files", "no file: the output is named", "no errno"],
)
def test_an_os_error_names_the_file_or_the_output(exc, output, expected):
    assert failures.one_line(exc, USER, output) == expected


def test_a_tensorflow_disk_error_keeps_the_path_and_the_reason_only():
    class ResourceExhaustedError(Exception):
        pass

    ResourceExhaustedError.__module__ = "tensorflow.python.framework.errors_impl"
    exc = ResourceExhaustedError(
        "{{function_node __wrapped__SaveV2_device_/job:localhost/CPU:0}} /r/step-0/ckpt.data; No space left on device "
        "[Op:SaveV2]"
    )
    assert failures.one_line(exc, USER) == "/r/step-0/ckpt.data; No space left on device"
    exc = ResourceExhaustedError("OOM when allocating tensor with shape [1000000, 1000000]")
    assert failures.one_line(exc, USER) is None  # not a disk: a bug report keeps its traceback


def test_a_python_worker_error_is_judged_by_its_class_name():
    class PythonException(Exception):
        pass

    PythonException.__module__ = "pyspark.errors.exceptions.captured"
    worker = (
        "An exception was thrown from the Python worker.\n"
        'Traceback (most recent call last):\n  File "x.py", line 1\n{}\n'
    )
    user = PythonException(worker.format("schemas.errors.SchemaError: embeddings: column 'embedding', row 3: is NaN"))
    assert failures.one_line(user, USER) == "embeddings: column 'embedding', row 3: is NaN"
    bug = PythonException(worker.format("KeyError: 'user_id'"))
    assert failures.one_line(bug, USER) is None


def test_anything_else_is_a_bug():
    assert failures.one_line(KeyError("config"), USER) is None
    assert failures.one_line(RuntimeError("boom"), USER) is None
