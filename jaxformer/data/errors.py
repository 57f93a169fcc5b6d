"""DataError: the data cannot be used as configured (every data module raises it)."""


class DataError(ValueError):
    """The data cannot be used as configured; the message names the problem and the fix."""
