"""The weight version vLLM reports for what it generates, checked against the version a batch is tagged with.

vLLM (0.32) labels the weights it generates with: the engine holds a label (``"default"`` at start), set by
``LLM.update_weight_version(label)`` in-process or ``POST /update_weight_version {"new_version": label}`` on a server
started in dev mode (``trl vllm-serve`` sets ``VLLM_SERVER_DEV_MODE=1``), read back with ``GET /weight_info``. Every
decoding step tags the tokens it sampled with the label of that moment, and a finished ``CompletionOutput`` carries
``weight_versions``: the spans ``[start, end)`` of its tokens and their labels.

The backends set the label to the version's number at every load (and at start, to ``-1``: the checkpoint's weights),
and check that every token was sampled by weights labelled with the version they loaded: the colocated engine records
the version it had loaded at each engine step and checks each token's label against the step that sampled it
(:func:`check_token_versions`; one version for the whole batch, or with ``in_flight_weight_updates`` the versions it
loaded between steps), and takes each token's version from its label. A batch sampled by weights other than those
recorded (a load behind the backend's back, or weights another process put on a shared server) fails with
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


def token_labels(output) -> list[str] | None:
    """The label of each token of the finished vLLM ``RequestOutput`` ``output`` (its one completion), from
    ``CompletionOutput.weight_versions``; None from a vLLM without the field (before 0.32). Raises
    :class:`WeightVersionMismatch` when the engine reported no label for its tokens."""
    completion = output.outputs[0]
    if not hasattr(completion, "weight_versions"):
        return None
    count = len(completion.token_ids)
    spans = completion.weight_versions
    if spans is None and count:
        raise WeightVersionMismatch(
            f"vLLM reported no weight version for request {output.request_id}; the backend labels every load."
        )
    labels: list[str | None] = [None] * count
    for span in spans or []:
        labels[span.start : span.end] = [span.version] * (span.end - span.start)
    if None in labels or len(labels) != count:
        raise WeightVersionMismatch(
            f"vLLM's weight version spans of request {output.request_id} ({spans}) do not cover its {count} tokens."
        )
    return labels


def check_token_versions(outputs, step_versions: list[list[int]]) -> list[list[int]]:
    """The version of each token of the finished vLLM ``RequestOutput``s ``outputs`` (one completion each), read from
    vLLM's own labels, after checking that each token's label is the one of ``step_versions[i][j]``: the version the
    backend had loaded at the engine step that sampled token ``j`` of output ``i``. Raises
    :class:`WeightVersionMismatch` otherwise. A vLLM without labels (before 0.32) is not checked: ``step_versions``
    is returned."""
    versions = []
    for output, expected in zip(outputs, step_versions, strict=True):
        labels = token_labels(output)
        if labels is None:
            return [list(row) for row in step_versions]
        if len(expected) != len(labels):
            raise WeightVersionMismatch(
                f"The backend recorded the engine steps of {len(expected)} tokens of request {output.request_id}, "
                f"vLLM returned {len(labels)}."
            )
        wrong, start = [], None
        for j in range(len(labels) + 1):
            bad = j < len(labels) and labels[j] != version_label(expected[j])
            if bad and start is None:
                start = j
            elif start is not None and (not bad or labels[j] != labels[start] or expected[j] != expected[start]):
                loaded = version_label(expected[start])
                wrong.append(f"tokens [{start}, {j}) by {labels[start]!r} (loaded: {loaded!r})")
                start = j if bad else None
        if wrong:
            raise WeightVersionMismatch(
                f"vLLM sampled request {output.request_id} with other weights than the backend had loaded at those "
                f"engine steps: {', '.join(wrong)}. The engine's weights were changed outside this backend."
            )
        versions.append([int(label) for label in labels])
    return versions


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
