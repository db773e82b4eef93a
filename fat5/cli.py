"""The command-line convention of every FAT5 command: both converters, pretraining and the recipes.

- Bad input or a refused request (`CommandError`, an `OSError` on the user's files, an argparse usage error):
  one line `error: ...` on stderr, exit status 2 (`EXIT_BAD_INPUT`).
- A self-check that found the command's own result wrong (`CheckFailed`: a conversion's logits parity, the demo's
  answers): one line `error: ...`, exit status 1 (`EXIT_CHECK_FAILED`).
- Output that cannot be written (`WriteFailed`: a full disk during a checkpoint or an export): one line
  `error: writing ... failed (...); <what the output folder holds>`, exit status 2.
- Training that met a non-finite gradient, loss or weight (`TrainingDiverged`): one line `error: training stopped
  at step N: ...; <what the output folder holds>`, exit status 1, nothing from that step on saved.
- Ctrl-C at any moment, imports included: one line `interrupted: <what the output folder holds>` on stderr,
  exit status 130 (`EXIT_INTERRUPTED`). SIGTERM (`kill`, a job scheduler, a container stopping) is handled the
  same way, with `terminated: ...` and exit status 143 (`EXIT_TERMINATED`).
- An optional library the command needs is not installed (an extra of pyproject.toml): one line naming the
  `pip install "fat5[EXTRA]"` that installs it, exit status 2.
- Anything else is a bug in FAT5 and keeps its traceback.
- On a terminal, a command that goes on to import torch and transformers (seconds) first says so in one line,
  `fat5 COMMAND: loading torch and transformers...` (`LoadingNotice`); a log or a pipe gets only the lines above.

Only the standard library is imported here (and `fat5/__init__.py` imports nothing until a model class is asked
for), so an entry point catches Ctrl-C while torch and transformers are still being imported, and answers --help
without torch. Nothing in a checkpoint folder needs this module: it is never exported.
"""

import argparse
import errno
import importlib.metadata
import importlib.util
import os
import re
import shutil
import signal
import sys
import threading
from contextlib import contextmanager

EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended
EXIT_OUTPUT_CLOSED = 141  # 128 + SIGPIPE: what a shell reports for `yes | head`, whose reader stopped reading
# The signals `run` handles: the word of its one line, and its exit status.
STOPPED_BY = {signal.SIGINT: ("interrupted", EXIT_INTERRUPTED), signal.SIGTERM: ("terminated", EXIT_TERMINATED)}


class CommandError(Exception):
    """Bad input or an impossible request: printed as one `error:` line, exit status 2."""

    says_what_the_output_holds = False  # `run` ends the line with what the output folder holds


class CheckFailed(CommandError):
    """The command checked its own result and found it wrong: one `error:` line, exit status 1."""


class WriteFailed(CommandError):
    """Writing the command's output failed (a full disk, a quota, a lost mount): one `error:` line that goes on to
    say what the output folder holds, exit status 2."""

    says_what_the_output_holds = True


class TrainingDiverged(CheckFailed):
    """Training met a non-finite gradient, loss or weight and stopped before saving it: one `error:` line that goes
    on to say what the output folder holds, exit status 1."""

    says_what_the_output_holds = True


# The extras of pyproject.toml a command may need, with the import names of the libraries each installs (a test holds
# this to pyproject.toml). A library several extras install is reported as the running command's extra.
EXTRAS = {
    "recipes": ("accelerate", "datasets", "sacrebleu", "rouge_score", "peft"),
    "pretrain": ("accelerate", "datasets"),
    "onnx": ("optimum", "onnxruntime"),
    "ct2": ("ctranslate2",),
    "liger": ("liger_kernel",),
    "triton": ("triton",),
}


# An extra whose libraries cap a library FAT5 needs, so that pip replaces a newer release of it with an older one:
# extra -> (library, the first release it excludes, what pip installs instead and why).
EXTRA_CAPS = {"onnx": ("transformers", (4, 58), "transformers 4.57 and huggingface_hub 0.x (optimum-onnx requires "
                                                "transformers < 4.58)")}


def extra_changes(extra):
    """What installing `extra` changes beyond adding its libraries, said before anything is installed ('' if
    nothing): the extras of EXTRA_CAPS replace an installed release their libraries exclude."""
    if extra not in EXTRA_CAPS:
        return ""
    library, cap, instead = EXTRA_CAPS[extra]
    try:
        installed = importlib.metadata.version(library)
    except importlib.metadata.PackageNotFoundError:
        return ""
    if tuple(int(part) for part in re.findall(r"\d+", installed)[:2]) < cap:
        return ""
    return f", which replaces {library} {installed} with {instead}; in a virtual environment of its own"


class MissingExtra(CommandError):
    """An optional library the command needs is not installed: one `error:` line with the pip command that installs
    it (and what else that changes), exit status 2."""

    def __init__(self, module, extra):
        super().__init__(f'{module} is not installed; this command needs FAT5\'s "{extra}" extra'
                         f'{extra_changes(extra)}: pip install "fat5[{extra}]"')


def extra_providing(module, extra=None):
    """The extra that installs the library imported as `module` (a dotted name counts as its top level): the
    command's own `extra` when that one does, else the first that does; None for a library no extra installs."""
    top = module.partition(".")[0]
    if extra is not None and top in EXTRAS[extra]:
        return extra
    return next((name for name, modules in EXTRAS.items() if top in modules), None)


def require(extra, *modules):
    """Raise MissingExtra for the first of `modules` (import names of `extra`'s libraries) that is not installed:
    before the command imports them or spends time on its work."""
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ValueError:  # imported without a spec: it is there
            found = True
        if not found:
            raise MissingExtra(module, extra_providing(module, extra))


def missing_extra(error, extra=None):
    """The MissingExtra an error stands for: a ModuleNotFoundError of a library an extra installs, or an error raised
    from one (a library's own ImportError saying what it lacks); None for any other."""
    while error is not None:
        module = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
        if module and extra_providing(module, extra) is not None:
            return MissingExtra(module.partition(".")[0], extra_providing(module, extra))
        error = error.__cause__
    return None


class CliParser(argparse.ArgumentParser):
    def error(self, message):
        # One line, no usage dump: bad input gets one clear error line.
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


class Progress:
    """What the command has done to the user's files so far, printed when it stops early. A command replaces
    `describe` once it has an output (e.g. with the converter's AtomicOutput.describe)."""

    def __init__(self):
        self.describe = lambda: "nothing was written"


def error_line(error):
    """The first line of an exception's message (a library's multi-line message becomes one line)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# torch.save's zip writer (PyTorchStreamWriter, inline_container.cc) fails with a RuntimeError that names no errno.
TORCH_WRITER_FAILED = re.compile(r"PytorchStreamWriter|inline_container\.cc")


def write_failure(error, folder=None):
    """Why a write failed, in a few words, when `error` is what a failed write raises, else None: an OSError from
    the system (ENOSPC: "No space left on device"; not one a library raises with a message only, such as
    transformers' missing files), safetensors' SafetensorError, or torch.save's RuntimeError, which names no cause
    (the OSError behind it when torch kept it, else the free space left in `folder`)."""
    from safetensors import SafetensorError

    if isinstance(error, OSError) and error.errno is not None:
        reason = error.strerror or error_line(error)
        return f"{reason}: {error.filename}" if error.filename and error.errno != errno.ENOSPC else reason
    if isinstance(error, SafetensorError) and "serializ" in str(error):
        return error_line(error).removeprefix("Error while serializing: ")
    if isinstance(error, RuntimeError) and TORCH_WRITER_FAILED.search(str(error)):
        return write_failure(error.__context__) or f"torch could not write a file{_free_space(folder)}"
    return None


def _free_space(folder):
    try:
        return f", {shutil.disk_usage(folder).free / 2**20:.1f} MiB free on its disk" if folder is not None else ""
    except OSError:
        return ""


@contextmanager
def write_failures_reported(what, folder=None):
    """A write that fails inside the block (a full disk, a quota, a read-only or lost mount) ends the command with
    one WriteFailed line naming `what` (written into `folder`); every other error passes unchanged."""
    try:
        yield
    except Exception as error:
        reason = write_failure(error, folder)
        if reason is None:
            raise
        raise WriteFailed(f"writing {what} failed ({reason})") from error


# The Ctrl-Cs and SIGTERMs the running command's main process received. Remembered rather than only raised: some
# libraries turn an interruption during their imports into another error, and Python drops an exception raised
# while it runs a `__del__` or a weakref callback (printing "Exception ignored ..."), after which the command would
# go on.
_interruptions = []
# The commands `run` has started in this process (`exit_with` tells an interruption before any from one after).
_commands_run = []


# What a command that imports torch and transformers says first, on a terminal: those imports take seconds (tens on a
# cold disk), and nothing else would show that the command started. "fat5 COMMAND" when fat5.commands runs it.
program = None
SLOW_IMPORTS = ("torch", "transformers", "datasets")  # datasets: the recipes import it first (pandas, pyarrow)


class LoadingNotice:
    """An import hook (first on sys.meta_path) that finds no module: when torch or transformers starts to load, it
    prints `fat5 COMMAND: loading torch and transformers...` to stderr, once, and removes itself (datasets, which
    imports them, counts too)."""

    def find_spec(self, name, path=None, target=None):
        if name in SLOW_IMPORTS:
            self.remove()
            print(f"{program + ': ' if program else ''}loading torch and transformers...", file=sys.stderr,
                  flush=True)
        return None

    def remove(self):
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def loading_notice():
    """The LoadingNotice a command installs: only where stderr is a terminal (a log or a pipe gets the command's
    own lines only, bad input its one `error:` line), and only while torch is not loaded yet."""
    if not any(name in sys.modules for name in SLOW_IMPORTS) and sys.stderr is not None and sys.stderr.isatty():
        notice = LoadingNotice()
        sys.meta_path.insert(0, notice)
        return notice
    return None


def raise_if_interrupted():
    """Raise the KeyboardInterrupt of a Ctrl-C (or SIGTERM) that Python dropped. Long loops call it at safe points
    (the Trainers' steps, fat5/training/run_folder.py), and `run` calls it when the command returns."""
    if _interruptions:
        raise KeyboardInterrupt


def run(command, argv=None, extra=None):
    """Call `command(argv, progress)`; return its exit status under the convention above. `extra`: the extra of
    pyproject.toml the command belongs to, named when one of its libraries is missing."""
    _commands_run.append(command)
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

    notice = loading_notice()
    in_main_thread = threading.current_thread() is threading.main_thread()
    # A signal the command was started with ignored stays ignored: a script's background job (`fat5 train ... &`)
    # inherits SIGINT ignored, so that the terminal's Ctrl-C does not reach it, as Python itself keeps it.
    previous = {number: signal.signal(number, on_signal) for number in STOPPED_BY
                if signal.getsignal(number) is not signal.SIG_IGN} if in_main_thread else {}
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
        error = missing_extra(error, extra) or error
        if not isinstance(error, (CommandError, OSError)):
            raise
        line = error_line(error)
        if getattr(error, "says_what_the_output_holds", False):
            line = f"{line}; {progress.describe()}"
        print(f"error: {line}", file=sys.stderr)
        return EXIT_CHECK_FAILED if isinstance(error, CheckFailed) else EXIT_BAD_INPUT
    finally:
        if notice is not None:
            notice.remove()
        _interruptions.clear()
        sys.unraisablehook, sys.excepthook = previous_unraisable, previous_excepthook
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 0


def stop_early(number, frame):
    """The SIGTERM handler of a command from its start (fat5/commands.py) until `run` installs its own: SIGTERM ends
    it as Ctrl-C does (`exit_with` then says `terminated`, exit status 143) rather than silently."""
    _interruptions.append(number)
    raise KeyboardInterrupt


def exit_with(main):
    """`sys.exit(main())`, with a Ctrl-C or SIGTERM after main returned (or while Python shuts down) ignored: the
    command is over, and its exit status says how it ended."""
    try:
        code = main()
        sys.stdout.flush()  # a reader gone early shows here, not as a traceback while Python exits
    except KeyboardInterrupt:  # raised before main's own handler (`run`), or between it and here
        word, code = STOPPED_BY[_interruptions[0] if _interruptions else signal.SIGINT]
        print(f"{word}: nothing was written" if not _commands_run else word, file=sys.stderr)
    except BrokenPipeError:
        # Standard output's reader stopped reading (`fat5 --help | head`): it has what it wanted. Nothing more can
        # be written there, so it points at /dev/null for Python's own flush at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_OUTPUT_CLOSED
    for number in STOPPED_BY:
        signal.signal(number, signal.SIG_IGN)
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        # Objects Python finalises as it exits report what the signal broke (as `run`'s hook says): the one line
        # has been printed.
        sys.unraisablehook = lambda report: None
    sys.exit(code)
