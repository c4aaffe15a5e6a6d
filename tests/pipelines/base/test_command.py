"""How a command ends (pipelines.base.command): its last line starts a line of its own, even when a
progress bar was drawing when it ended (an error, Ctrl-C, or SIGTERM from a scheduler)."""

import subprocess
import sys
import textwrap

import pytest

ENDINGS = {
    "error": ("raise UserError('bad input')", 2, "ssp probe: error: bad input"),
    "bug": (
        "raise KeyError('planted')",
        3,
        "ssp probe: internal error (a bug, not a problem with the input): KeyError: 'planted'; its traceback is in ",
    ),
    "interrupt": ("raise KeyboardInterrupt", 130, "ssp probe: interrupted; nothing partial was published"),
    "terminate": (
        "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)",
        143,
        "ssp probe: terminated; nothing partial was published",
    ),
}


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_the_last_line_starts_its_own_line_after_an_unfinished_progress_bar(ending):
    how, status, line = ENDINGS[ending]
    script = textwrap.dedent(f"""
        import os, signal, sys, time
        from tqdm import tqdm
        from pipelines.base import command
        from schemas.errors import UserError

        def action():
            bar = tqdm(total=10, desc="probe", file=sys.stderr)
            bar.update(3)
            bar.refresh()  # drawn, its line unfinished
            {how}

        code = command.run("probe", action)
        sys.stderr.flush()
        os._exit(code)  # as the installed `ssp` leaves after a failure (ssp.cli.entry): the bar is never closed
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == status, result.stderr
    lines = result.stderr.split("\n")
    assert lines[-1] == "" and lines[-2].startswith(line), result.stderr  # the last line, whole, on its own
    assert "probe:  30%" in lines[-3], result.stderr  # the bar, left as it was drawn
