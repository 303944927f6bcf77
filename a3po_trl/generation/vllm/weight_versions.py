"""The weight version vLLM reports for what it generates, checked against the version a batch is tagged with.

vLLM (0.32) labels the weights it generates with: the engine holds a label (``"default"`` at start), set by
``LLM.update_weight_version(label)`` in-process or ``POST /update_weight_version {"new_version": label}`` on a server
started in dev mode (``trl vllm-serve`` sets ``VLLM_SERVER_DEV_MODE=1``), read back with ``GET /weight_info``. Every
decoding step tags the tokens it sampled with the label of that moment, and a finished ``CompletionOutput`` carries
``weight_versions``: the spans ``[start, end)`` of its tokens and their labels.

The backends set the label to the version's number at every load (and at start, to ``-1``: the checkpoint's weights),
and check that every token of a batch was sampled by weights labelled with the version the batch is tagged with: a
batch generated across a load, or by weights another process put on a shared server, fails with
:class:`WeightVersionMismatch` instead of training with the wrong behavior policy. The OpenAI ``/v1/completions``
route does not return the spans; the server backend reads the server's label before and after a batch instead.
"""

from __future__ import annotations

INITIAL_VERSION_LABEL = "-1"
"""The label of the engine's first weights (the checkpoint it starts from: the backend's version -1)."""


class WeightVersionMismatch(RuntimeError):
    """vLLM reports weights other than the version the batch is tagged with."""


def version_label(version: int) -> str:
    """The label vLLM holds for the trainer's weight version ``version``."""
    return str(int(version))


def check_outputs_version(outputs, version: int) -> None:
    """Raise :class:`WeightVersionMismatch` unless every token of the finished vLLM ``RequestOutput``s ``outputs`` was
    sampled by weights labelled ``version`` (``CompletionOutput.weight_versions``). A vLLM without the field (before
    0.32) is not checked."""
    expected = version_label(version)
    for output in outputs:
        for completion in output.outputs:
            if not hasattr(completion, "weight_versions"):
                return
            spans = completion.weight_versions
            if spans is None:
                raise WeightVersionMismatch(
                    f"vLLM reported no weight version for request {output.request_id}; the backend labels every "
                    f"load (batch tagged with version {expected})."
                )
            wrong = [f"tokens [{s.start}, {s.end}) by {s.version!r}" for s in spans if s.version != expected]
            if wrong:
                raise WeightVersionMismatch(
                    f"vLLM sampled request {output.request_id} with other weights than the batch's version "
                    f"{expected!r}: {', '.join(wrong)}. A version was loaded while the batch was generated, or the "
                    "engine's weights were changed outside this backend."
                )


def check_server_version(reported: str, version: int, when: str) -> None:
    """Raise :class:`WeightVersionMismatch` unless the server's label ``reported`` (``GET /weight_info``, read
    ``when``) is ``version``'s."""
    expected = version_label(version)
    if reported != expected:
        raise WeightVersionMismatch(
            f"The vLLM server holds weights labelled {reported!r} {when} a batch tagged with version {expected!r}: "
            "another client changed its weights (a server shared by several training runs, or by processes that do "
            "not agree on its version), or a load did not finish."
        )
