"""The one error type our commands report as a single line: bad input (a path, a file, a setting) named with the fix.

Library code raises `InputError` (or a subclass such as `minimind.data.DataFormatError`) where the cause is what
the user gave; `minimind.cli.command` prints its message as `error: ...` and exits with status 2, no traceback.
"""


class InputError(ValueError):
    """A command's input is unusable: the message names it and says what to do instead."""
