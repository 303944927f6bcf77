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
    return labels_from_spans([(span.version, span.start, span.end) for span in spans or []], count, output.request_id)


def labels_from_spans(spans, count: int, request: str) -> list[str]:
    """The label of each of ``count`` tokens from vLLM's spans ``(label, start, end)`` of request ``request``; raises
    :class:`WeightVersionMismatch` unless they cover every token once."""
    labels: list[str | None] = [None] * count
    for label, start, end in spans:
        labels[start:end] = [label] * (end - start)
    if None in labels or len(labels) != count:
        raise WeightVersionMismatch(
            f"vLLM's weight version spans of request {request} ({list(spans)}) do not cover its {count} tokens."
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


def check_server_token_versions(labels: list[list[str]], loaded: list[int], loads) -> list[list[int]]:
    """The version of each token of a server batch's completions from the server's labels ``labels`` (one row per
    completion), after checking them against what the backend loaded: every label is one of the versions ``loaded``
    during the batch (in load order), a completion's labels never go back to an older version, and for each in-flight
    load ``(replaced, received)`` the first ``received[i]`` tokens of completion ``i`` (those the backend had received
    when it paused the server to load) were sampled by ``replaced`` or older. Raises :class:`WeightVersionMismatch`
    otherwise (weights another client put on the server, or a load that did not pause it)."""
    known = {version_label(v): v for v in loaded}
    versions = []
    for i, row in enumerate(labels):
        strange = sorted({label for label in row if label not in known})
        if strange:
            raise WeightVersionMismatch(
                f"The vLLM server sampled completion {i} with weights labelled {strange}, none of the versions this "
                f"backend loaded during the batch ({sorted(known)}): another client changed its weights."
            )
        row_versions = [known[label] for label in row]
        if any(later < earlier for earlier, later in zip(row_versions, row_versions[1:])):
            raise WeightVersionMismatch(
                f"The vLLM server's labels of completion {i} go back to an older version ({row}): its weights were "
                "changed outside this backend."
            )
        for replaced, received in loads:
            early = row_versions[: received[i]]
            if any(v > replaced for v in early):
                raise WeightVersionMismatch(
                    f"The vLLM server labelled tokens of completion {i} received before version {replaced} was "
                    f"replaced with a newer version ({row[: received[i]]}): a load reached the server without a pause."
                )
        versions.append(row_versions)
    return versions
