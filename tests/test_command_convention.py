"""fat5/cli.py's `run`, the convention every FAT5 command follows, on the Ctrl-Cs a training run meets: one
`interrupted:` line and exit status 130 whatever the moment, never a run that goes on; and on SIGTERM, handled the
same way with one `terminated:` line and exit status 143."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fat5.cli import EXIT_INTERRUPTED, EXIT_TERMINATED, run
from fat5.convert.demo import DEMO_CHECKPOINT
from fat5.convert.safety import STAGING_MARK

REPO = Path(__file__).resolve().parent.parent


def test_a_ctrl_c_that_python_drops_still_ends_the_command_in_one_line(capsys):
    """Python drops an exception raised while a `__del__` runs (as a DataLoader iterator's does when the Trainer
    starts an epoch); the command must still stop, with no "Exception ignored" traceback."""
    reached = []

    class Finalised:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    def command(argv, progress):
        progress.describe = lambda: "OUT holds checkpoint-2"
        Finalised()
        reached.append("the rest of the command")

    assert run(command, []) == EXIT_INTERRUPTED
    assert reached  # the KeyboardInterrupt was dropped, as Python does
    assert capsys.readouterr().err.splitlines() == ["interrupted: OUT holds checkpoint-2"]


def test_forked_workers_carry_on_through_the_ctrl_c_their_main_process_handles(capfd):
    """A terminal's Ctrl-C also reaches the data-loader workers the command forked: they inherit the handler and
    must not print a traceback of their own (their main process stops them), not even for the connection to
    their interrupted main process that a worker's thread then finds closed."""

    def command(argv, progress):
        child = os.fork()
        if child == 0:
            try:
                signal.raise_signal(signal.SIGINT)
                error = ConnectionResetError("the main process closed the connection")
                sys.excepthook(type(error), error, None)
            except KeyboardInterrupt:
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0

    assert run(command, []) == 0
    assert capfd.readouterr().err == ""


def test_sigterm_is_handled_as_ctrl_c_with_its_own_word_and_status(capsys):
    """SIGTERM (`kill`, a job scheduler, a container stopping) runs the clean-up a Ctrl-C runs, and says so in one
    line: `terminated: <what the output folder holds>`, exit status 143 (128 + SIGTERM, as a shell reports it)."""
    cleaned = []

    def command(argv, progress):
        progress.describe = lambda: "OUT holds checkpoint-2"
        try:
            signal.raise_signal(signal.SIGTERM)
        finally:
            cleaned.append("staging folder removed")

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGCHLD)
    try:
        assert run(command, []) == EXIT_TERMINATED == 143
        # torch's SIGCHLD handler would report the DataLoader workers the SIGTERM also ended.
        assert signal.getsignal(signal.SIGCHLD) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGCHLD, before[1])
    assert cleaned
    assert capsys.readouterr().err.splitlines() == ["terminated: OUT holds checkpoint-2"]
    assert signal.getsignal(signal.SIGTERM) is before[0]  # the handler is the command's only


def test_a_forked_child_ends_on_sigterm_without_a_word(capfd):
    """A process the command forked ends at once on SIGTERM, quietly, as SIGTERM's default does (its main process,
    which gets the process group's SIGTERM too, says what happened)."""

    def command(argv, progress):
        child = os.fork()
        if child == 0:
            try:
                signal.raise_signal(signal.SIGTERM)
            except BaseException:
                os._exit(1)
            os._exit(0)  # not reached: the signal ends the child
        _, status = os.waitpid(child, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM

    assert run(command, []) == 0
    assert capfd.readouterr().err == ""


def test_a_forked_worker_never_reports_the_connection_its_main_process_closed(capfd):
    """When only the main process gets the signal (`kill PID`), a worker's thread still finds the connection a batch
    was travelling on closed: not the worker's to report. Its other reports are."""

    def command(argv, progress):
        child = os.fork()
        if child == 0:
            error = ConnectionResetError("the main process closed the connection")
            sys.excepthook(type(error), error, None)
            error = ValueError("a worker's own failure")
            sys.excepthook(type(error), error, None)
            sys.stderr.flush()
            os._exit(0)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0

    assert run(command, []) == 0
    assert capfd.readouterr().err.strip().splitlines() == ["ValueError: a worker's own failure"]


def test_sigterm_while_converting_leaves_nothing_and_says_so(tmp_path):
    out = tmp_path / "out"
    process = subprocess.Popen([sys.executable, "-m", "convert.flan_to_fat5", str(DEMO_CHECKPOINT), str(out)],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not staging_folders(tmp_path) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, process.stderr.read()[-3000:]
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 143, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and "%|" not in line and "it/s]" not in line]
    assert lines == [f"terminated: nothing was written to {out}"], err[-3000:]
    assert not out.exists() and not staging_folders(tmp_path)


def staging_folders(parent):
    return [path for path in parent.iterdir() if STAGING_MARK in path.name]
