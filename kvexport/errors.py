"""The user's errors: bad config, bad input, missing file. The CLI prints one line and exits 2.

Anything else that escapes is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A problem with what the user gave us; the message is one line naming it."""

    exit_code = 2


class VerificationError(UserError):
    """An artifact does not compute (or no longer holds) what it should; exit 1."""

    exit_code = 1


class RequestFailed(UserError):
    """The package refused a request; `code` is the runtime's reason (kvexport::last_error):
    "invalid_request", "capacity_exceeded" or "internal"."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class RequestError(RequestFailed):
    """A request that breaks the signature or the package's limits: code "invalid_request". Its
    structure is refused in Python before the package runs (kvexport.host.requests), its values by
    the package's own check (check_request), which every route runs once."""

    def __init__(self, message: str):
        super().__init__("invalid_request", message)
