"""The one exception type a user sees: it says what is wrong and what to do, and the CLI prints it
without a traceback. Anything else escaping is a bug and keeps its traceback."""


class KTOPipelineError(Exception):
    """A problem with the user's input, files or settings, with a message that names the fix."""
