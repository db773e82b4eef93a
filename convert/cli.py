"""The command-line convention of every FAT5 command: both converters, pretraining and the recipes.

- Bad input or a refused request (`CommandError`, an `OSError` on the user's files, an argparse usage error):
  one line `error: ...` on stderr, exit status 2 (`EXIT_BAD_INPUT`).
- A self-check that found the command's own result wrong (`CheckFailed`: a conversion's logits parity, the demo's
  answers): one line `error: ...`, exit status 1 (`EXIT_CHECK_FAILED`).
- Output that cannot be written (`WriteFailed`: a full disk during a checkpoint or an export): one line
  `error: writing ... failed (...); <what the output folder holds>`, exit status 2.
- Ctrl-C at any moment, imports included: one line `interrupted: <what the output folder holds>` on stderr,
  exit status 130 (`EXIT_INTERRUPTED`). SIGTERM (`kill`, a job scheduler, a container stopping) is handled the
  same way, with `terminated: ...` and exit status 143 (`EXIT_TERMINATED`).
- Anything else is a bug in FAT5 and keeps its traceback.

Only the standard library is imported here, so an entry point catches Ctrl-C while torch and transformers are
still being imported. (It lives in `convert/` rather than `fat5/` because importing anything under `fat5`
imports transformers first.)
"""

import argparse
import os
import signal
import sys
import threading

EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended
# The signals `run` handles: the word of its one line, and its exit status.
STOPPED_BY = {signal.SIGINT: ("interrupted", EXIT_INTERRUPTED), signal.SIGTERM: ("terminated", EXIT_TERMINATED)}


class CommandError(Exception):
    """Bad input or an impossible request: printed as one `error:` line, exit status 2."""


class CheckFailed(CommandError):
    """The command checked its own result and found it wrong: one `error:` line, exit status 1."""


class WriteFailed(CommandError):
    """Writing the command's output failed (a full disk, a quota, a lost mount): one `error:` line that goes on to
    say what the output folder holds, exit status 2."""


class CliParser(argparse.ArgumentParser):
    def error(self, message):
        # One line, no usage dump: bad input gets one clear error line.
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


class Progress:
    """What the command has done to the user's files so far, printed when it stops early. A command replaces
    `describe` once it has an output (e.g. with the converter's AtomicOutput.describe)."""

    def __init__(self):
        self.describe = lambda: "nothing was written"


def add_output_arguments(parser, verify_help):
    """The options both converters share: shard size, replacing OUT, verification, non-finite weights."""
    parser.add_argument("--max-shard-size", default="5GB",
                        help="largest safetensors shard, e.g. 5GB, 500MB (default: 5GB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace OUT if it exists and is not empty (atomically: OUT is always either the "
                             "old or the new folder)")
    parser.add_argument("--no-verify", action="store_true", help=verify_help)
    parser.add_argument("--allow-non-finite", action="store_true",
                        help="convert tensors holding NaN or infinite values instead of refusing them")


def error_line(error):
    """The first line of an exception's message (a library's multi-line message becomes one line)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# The Ctrl-Cs and SIGTERMs the running command's main process received. Remembered rather than only raised: some
# libraries turn an interruption during their imports into another error, and Python drops an exception raised
# while it runs a `__del__` or a weakref callback (printing "Exception ignored ..."), after which the command would
# go on.
_interruptions = []


def raise_if_interrupted():
    """Raise the KeyboardInterrupt of a Ctrl-C (or SIGTERM) that Python dropped. Long loops call it at safe points
    (the Trainers' steps, fat5/training/run_folder.py), and `run` calls it when the command returns."""
    if _interruptions:
        raise KeyboardInterrupt


def run(command, argv=None):
    """Call `command(argv, progress)`; return its exit status under the convention above."""
    progress = Progress()
    main_process = os.getpid()
    _interruptions.clear()

    def on_signal(number, frame):
        _interruptions.append(number)
        if os.getpid() == main_process:
            if number == signal.SIGTERM:
                # A SIGTERM to the process group also ends the DataLoader workers, and torch's SIGCHLD handler would
                # report each end as an error wherever this process then is, even while it prints its one line or
                # exits: they are expected now. (Left so: the command is over.)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            # SIGTERM raises KeyboardInterrupt too, so that every clean-up written for a Ctrl-C runs for it
            # (staging folders, progress bars, the run folder's lock); `stopped` tells them apart.
            raise KeyboardInterrupt
        if number == signal.SIGTERM:
            # A forked child told to end (by its main process, or with its whole process group) ends at once and
            # without a word, as SIGTERM's default action does; its main process says what happened. (torch's
            # DataLoader workers replace this handler with their own, which does the same.)
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
        # A forked data-loader worker inherits this handler and, in the terminal's process group, gets the same
        # Ctrl-C: it carries on until its main process, interrupted, stops it.

    def stopped():
        word, status = STOPPED_BY[_interruptions[0] if _interruptions else signal.SIGINT]
        print(f"{word}: {progress.describe()}", file=sys.stderr)
        return status

    def on_unraisable(report):
        # The dropped KeyboardInterrupt of a Ctrl-C is raised again by raise_if_interrupted: no traceback for it. Nor
        # for what a finaliser finds broken by the signal once one arrived, such as a DataLoader iterator whose
        # workers the process group's SIGTERM ended ("DataLoader worker ... is killed by signal: Terminated").
        if not _interruptions:
            previous_unraisable(report)

    def on_uncaught(exc_type, *exc_info):
        # In a forked worker after a Ctrl-C, what it broke is no bug to report: a worker's thread handing a batch to
        # its main process, which the Ctrl-C interrupted, reports the closed connection through sys.excepthook. The
        # same report comes when only the main process got the signal (`kill PID`): a connection its main process
        # closed is never a forked worker's to report.
        forked = os.getpid() != main_process
        if not (forked and (_interruptions or issubclass(exc_type, ConnectionError))):
            previous_excepthook(exc_type, *exc_info)

    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = {number: signal.signal(number, on_signal) for number in STOPPED_BY} if in_main_thread else {}
    previous_unraisable, sys.unraisablehook = sys.unraisablehook, on_unraisable
    previous_excepthook, sys.excepthook = sys.excepthook, on_uncaught
    try:
        command(argv, progress)
        raise_if_interrupted()
    except KeyboardInterrupt:
        return stopped()
    except Exception as error:
        if _interruptions:
            return stopped()
        if not isinstance(error, (CommandError, OSError)):
            raise
        line = error_line(error)
        if isinstance(error, WriteFailed):
            line = f"{line}; {progress.describe()}"
        print(f"error: {line}", file=sys.stderr)
        return EXIT_CHECK_FAILED if isinstance(error, CheckFailed) else EXIT_BAD_INPUT
    finally:
        _interruptions.clear()
        sys.unraisablehook, sys.excepthook = previous_unraisable, previous_excepthook
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 0


def exit_with(main):
    """`sys.exit(main())`, with a Ctrl-C or SIGTERM after main returned (or while Python shuts down) ignored: the
    command is over, and its exit status says how it ended."""
    try:
        code = main()
    except KeyboardInterrupt:  # raised between main's own handler and here
        print("interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    for number in STOPPED_BY:
        signal.signal(number, signal.SIG_IGN)
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        # Objects Python finalises as it exits report what the signal broke (as `run`'s hook says): the one line
        # has been printed.
        sys.unraisablehook = lambda report: None
    sys.exit(code)
