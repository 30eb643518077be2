"""The package's exceptions: `AmoeError` and, for the library's argument
statuses, subclasses that are also the standard `ValueError` / `TypeError`, so
`except ValueError` catches a bad shape or argument and `except TypeError` a
bad dtype.

This module imports nothing of the package; statuses are matched by their
`Status` member names, never by number."""

from __future__ import annotations


class AmoeError(RuntimeError):
    """A call into the library failed. `str(err)` is the library's message;
    `err.status` the `Status` code."""

    def __init__(self, status, message: str):
        self.status = status
        self.message = message
        super().__init__(message)

    def __reduce__(self):
        # Rebuilt from both arguments: pickling (a worker process sending its
        # error back, `copy`) would otherwise call `cls(message)` alone. The
        # instance's other attributes (`__notes__` of `add_note`, ...) go along.
        return (type(self), (self.status, self.message), self.__dict__)


class NullArgumentError(AmoeError, ValueError):
    """`Status.NULL_ARGUMENT`: a required argument was missing (or closed)."""


class InvalidArgumentError(AmoeError, ValueError):
    """`Status.INVALID_ARGUMENT`: an argument has a value the op does not accept."""


class ShapeError(AmoeError, ValueError):
    """`Status.SHAPE`: a tensor has the wrong shape."""


class DTypeError(AmoeError, TypeError):
    """`Status.DTYPE`: a tensor has the wrong dtype, or a dtype is unknown."""


class IndexOutOfRangeError(AmoeError, ValueError):
    """`Status.INDEX_OUT_OF_RANGE`: an index tensor holds a value outside its range."""


class DeviceError(AmoeError, ValueError):
    """`Status.DEVICE`: a tensor is on the wrong device, or a device is unknown."""


class BufferTooSmallError(AmoeError, ValueError):
    """`Status.BUFFER_TOO_SMALL`: a caller-provided buffer is too small."""


class HostMemoryError(AmoeError, MemoryError):
    """`Status.HOST_MEMORY`: host memory could not be allocated (the message
    names the call and the size)."""


# `Status` member name -> its exception class; every other status is `AmoeError`.
BY_STATUS_NAME = {
    "NULL_ARGUMENT": NullArgumentError,
    "INVALID_ARGUMENT": InvalidArgumentError,
    "SHAPE": ShapeError,
    "DTYPE": DTypeError,
    "INDEX_OUT_OF_RANGE": IndexOutOfRangeError,
    "DEVICE": DeviceError,
    "BUFFER_TOO_SMALL": BufferTooSmallError,
    "HOST_MEMORY": HostMemoryError,
}


def error(status, message: str) -> AmoeError:
    """The exception for `status` (a `Status` member, or an unknown code)."""
    cls = BY_STATUS_NAME.get(getattr(status, "name", None), AmoeError)
    return cls(status, message)
