"""The error of a vLLM server the backend talks to (its own module: the server backend and its in-flight loads both
raise it)."""


class VLLMServerError(RuntimeError):
    """The vLLM server could not be reached, answered with an error, or did not answer in time."""
