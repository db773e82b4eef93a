"""What both converter commands share: one-line errors, exit codes, and Ctrl-C at any moment.

Only the standard library is imported here, so the entry points can catch Ctrl-C while torch and transformers
are still being imported.
"""

import argparse
import signal
import sys
import threading


class UserError(Exception):
    """Bad input or an impossible request; printed as one `error:` line, exit status 1."""


class CliParser(argparse.ArgumentParser):
    def error(self, message):
        # One line, no usage dump: bad input gets one clear error line.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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


class Progress:
    """What the run has done to OUT so far, for the message printed when it stops early."""

    def __init__(self):
        self.output = None  # the AtomicOutput, once OUT has been checked

    def describe(self):
        return self.output.describe() if self.output is not None else "nothing was written"


def run(convert, parser, argv=None):
    """Parse `argv` and call convert(args, progress); turn UserError/OSError into one line and exit status 1,
    and Ctrl-C (imports included) into one line saying what OUT holds, exit status 130."""
    progress = Progress()
    interrupted = []

    def on_interrupt(number, frame):
        interrupted.append(number)
        raise KeyboardInterrupt

    # Some libraries turn an interruption during their imports into another error: remember the signal itself.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, on_interrupt) if in_main_thread else None
    try:
        args = parser.parse_args(argv)
        convert(args, progress)
    except KeyboardInterrupt:
        print(f"interrupted: {progress.describe()}", file=sys.stderr)
        return 130
    except Exception as error:
        if interrupted:
            print(f"interrupted: {progress.describe()}", file=sys.stderr)
            return 130
        if not isinstance(error, (UserError, OSError)):
            raise
        text = str(error).strip()
        print(f"error: {text.splitlines()[0] if text else type(error).__name__}", file=sys.stderr)
        return 1
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)
    return 0


def exit_with(main):
    """`sys.exit(main())`, with a Ctrl-C after main returned (or while Python shuts down) ignored."""
    try:
        code = main()
    except KeyboardInterrupt:  # raised between main's own handler and here
        print("interrupted", file=sys.stderr)
        code = 130
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(code)
