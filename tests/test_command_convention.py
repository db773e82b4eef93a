"""convert/cli.py's `run`, the convention every FAT5 command follows, on the Ctrl-Cs a training run meets: one
`interrupted:` line and exit status 130 whatever the moment, never a run that goes on."""

import os
import signal
import sys

from convert.cli import EXIT_INTERRUPTED, run


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
