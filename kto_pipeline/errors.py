"""The exceptions a user sees: each says what is wrong, or what happened, and what to do, and the CLI prints it
without a traceback. Anything else escaping is a bug and keeps its traceback."""

PREEMPTED_EXIT = 75  # EX_TEMPFAIL (sysexits.h): stopped before the end, the work so far kept; run it again


class KTOPipelineError(Exception):
    """A problem with the user's input, files or settings, with a message that names the fix."""


class Preempted(KTOPipelineError):
    """A stage stopped on request (SIGTERM, SIGUSR1) at a step boundary, its work kept; the message says how to
    continue. The command line exits with `PREEMPTED_EXIT`."""

    exit_code = PREEMPTED_EXIT


class Interrupted(Preempted):
    """Training stopped at a step boundary on Ctrl-C, its checkpoint written; the command line exits with 130, the
    shell's status for a command ended by SIGINT."""

    exit_code = 130


def flag(name: str) -> str:
    """A config field's name as its command-line flag: loss_type -> --loss-type."""
    return "--" + name.replace("_", "-")


def check_option(cond: bool, name: str, message: str) -> None:
    """Refuse a setting: `--NAME: MESSAGE`."""
    if not cond:
        raise KTOPipelineError(f"{flag(name)}: {message}")
