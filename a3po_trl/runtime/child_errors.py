"""An exception raised in a child process (a reward worker, the generation process), carried back to the trainer."""

from __future__ import annotations

import pickle
import traceback


class CapturedError:
    """An exception as the child process saw it: the exception itself where it survives pickling, its text, and its
    traceback (which does not cross processes with it)."""

    def __init__(self, error: BaseException):
        self.traceback = "".join(traceback.format_exception(error))
        self.summary = f"{type(error).__name__}: {error}"
        try:
            self.error = pickle.loads(pickle.dumps(error))
        except Exception:
            self.error = None

    def raised_here(self, traceback_type: type[Exception]) -> BaseException:
        """The exception to raise in the trainer (a ``RuntimeError`` carrying its text if it could not be pickled),
        the child's traceback as its cause, wrapped in ``traceback_type``."""
        error = self.error if self.error is not None else RuntimeError(self.summary)
        error.__cause__ = traceback_type(self.traceback)
        return error
