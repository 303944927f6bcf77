"""How the generator samples and scores what it samples, with Hugging Face ``generate``.

- :class:`OwnStreamSampling` draws every token from a ``torch.Generator`` the generator owns, so nothing the training
  thread does to the global RNG (gradient checkpointing forks and restores it) can make the generator replay random
  numbers it already used.
- :class:`GenerationLogpsRecorder` records the behavior log-prob of every picked token from the logits ``generate``
  computes anyway, instead of a second forward pass: under the policy's temperature-scaled distribution, and, when
  the sampler truncates or penalises it (top-k/p, min-p, repetition penalties, ...), also under the distribution the
  token was really drawn from.
- :func:`sampling_deviations` lists what in the effective generation config makes ``generate`` sample from another
  distribution than the temperature-scaled one the training log-probs score.

Under truncated sampling there are two behavior quantities (both backends agree on them; see the README): the
*policy* log-prob ``log softmax(logits / T)`` of the weights that generated the token, the trust-region anchor, which
the trainer's forward reproduces (so an on-policy token has ratio 1); and the *sampling* log-prob, of the processed
distribution the token was drawn from, the denominator of the behavior weight ``pi_prox / pi_sampling``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList


class _GumbelMaxNoise(LogitsProcessor):
    """Adds ``-log(E)``, ``E ~ Exp(1)`` from its own generator: the argmax of the result is a sample of
    ``softmax(scores)`` (the Gumbel-max trick), so greedy selection of the output samples the distribution."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        noise = torch.empty_like(scores, dtype=torch.float32).exponential_(generator=self.generator)
        return scores.float() - noise.log()


class OwnStreamSampling:
    """A ``custom_generate`` decoding method for ``model.generate``: transformers' multinomial sampling with every
    processor and warper ``generate`` builds (temperature, top-k, ...), except that the token is drawn with the
    Gumbel-max trick from ``generator`` instead of ``torch.multinomial`` on the global RNG.

    ``model.generate(..., custom_generate=OwnStreamSampling(generator))`` samples exactly the distribution plain
    ``generate`` samples; only the source of randomness differs. ``observe`` (a logits processor that returns the
    scores unchanged) sees the final scores of every step, those the token is drawn from: custom processors given to
    ``generate`` run before its warpers (temperature, top-k/p), so this is the one place that sees them all.
    """

    def __init__(self, generator: torch.Generator, observe: LogitsProcessor | None = None):
        self.generator = generator
        self.observe = observe

    def __call__(self, model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        observers = [self.observe] if self.observe is not None else []
        processors = LogitsProcessorList([*logits_processor, *observers, _GumbelMaxNoise(self.generator)])
        greedy = copy.copy(generation_config)
        greedy.do_sample = False  # the noise already made the choice: take the argmax
        return model._sample(
            input_ids,
            logits_processor=processors,
            stopping_criteria=stopping_criteria,
            generation_config=greedy,
            synced_gpus=False,
            streamer=None,
            **model_kwargs,
        )


def samples_with_own_stream(config: GenerationConfig) -> bool:
    """Whether ``config`` is plain multinomial sampling, the decoding :class:`OwnStreamSampling` replaces."""
    return bool(config.do_sample) and (config.num_beams or 1) == 1 and not _assisted(config)


def records_logps(config: GenerationConfig) -> bool:
    """Whether ``generate`` runs one forward per generated token for this config, which the recorder needs."""
    return (config.num_beams or 1) == 1 and not _assisted(config) and not getattr(config, "prefill_chunk_size", None)


def _assisted(config: GenerationConfig) -> bool:
    return bool(
        getattr(config, "prompt_lookup_num_tokens", None)
        or getattr(config, "assistant_early_exit", None)
        or getattr(config, "penalty_alpha", None)
        or getattr(config, "dola_layers", None)
    )


# Generation-config fields that make generate sample from another distribution than softmax(logits / temperature),
# with the values that leave the distribution unchanged.
_NEUTRAL_VALUES = {
    "top_k": (None, 0),
    "top_p": (None, 1.0),
    "min_p": (None,),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "top_h": (None,),
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "bad_words_ids": (None, []),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "sequence_bias": (None, {}),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "exponential_decay_length_penalty": (None,),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
    "penalty_alpha": (None, 0.0),
    "dola_layers": (None,),
    "prompt_lookup_num_tokens": (None, 0),
}


def processed_sampling(config: GenerationConfig) -> list[str]:
    """``"name=value"`` for every logits processor setting of ``config`` (an effective, merged generation config)
    that makes sampling draw from a processed distribution instead of ``softmax(logits / temperature)``: truncation
    (top-k/p, min-p, typical), penalties, banned or forced tokens, minimum lengths. Under plain sampling the generator
    records the log-probs of that processed distribution too (:class:`GenerationLogpsRecorder`)."""
    return [
        f"{name}={getattr(config, name, None)!r}"
        for name, neutral in _NEUTRAL_VALUES.items()
        if getattr(config, name, None) not in neutral
    ]


def sampling_deviations(config: GenerationConfig) -> list[str]:
    """``"name=value"`` for every setting of ``config`` (an effective, merged generation config) under which
    ``generate`` does not draw tokens from ``softmax(logits / temperature)``: truncation (top-k/p, min-p, typical),
    penalties, banned or forced tokens, minimum lengths, beams, greedy decoding."""
    deviations = []
    if not config.do_sample:
        deviations.append("do_sample=False")
    if (config.num_beams or 1) > 1:
        deviations.append(f"num_beams={config.num_beams}")
    return deviations + processed_sampling(config)


class GenerationLogpsRecorder:
    """Records, while ``generate`` runs, the log-probs of every token it picks.

    A forward hook on the causal LM that ``generate`` calls sees each step's logits (the raw ones, before any logits
    processor) and the token ids fed into the next step, which are the tokens picked from those logits. Only the
    latest step's ``(B, V)`` log-softmax is kept, so the cost is one log-softmax per step and ``(B, steps)`` floats:
    the behavior log-probs come out of the generation itself instead of a second forward over the whole batch.
    They score the same distribution as the training log-probs (raw logits / temperature, no top-k/top-p), with the
    numerics of incremental decoding (KV cache) instead of one full-sequence forward.

    With ``record_sampling=True`` it also records the log-probs under the distribution the token was drawn from:
    :attr:`sampling_observer`, given to :class:`OwnStreamSampling`, sees each step's scores after every processor
    (penalties, temperature, top-k/top-p, min-p, ...), and their log-softmax is gathered at the picked token the same
    way (one more log-softmax per step).
    """

    def __init__(self, model: nn.Module, temperature: float, record_sampling: bool = False):
        if temperature <= 0:
            raise ValueError(f"temperature={temperature} must be positive to score the sampled tokens.")
        self.temperature = temperature
        self._latest: torch.Tensor | None = None
        self._latest_sampling: torch.Tensor | None = None
        self._columns: list[torch.Tensor] = []
        self._sampling_columns: list[torch.Tensor] = []
        self._picked: list[torch.Tensor] = []  # the token each column scores, checked against the output
        self.sampling_logps: torch.Tensor | None = None
        self.sampling_observer = _ProcessedScoresObserver(self) if record_sampling else None
        self._handle = model.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        logits = getattr(output, "logits", None)
        if input_ids is None or logits is None:
            self._latest = None
            self._columns.clear()  # cannot record with this model: finish() reports a misalignment
            return
        if self._latest is not None:
            picked = input_ids[:, -1:].to(self._latest.device)
            if picked.size(0) == self._latest.size(0):
                self._take(picked)
        self._latest = torch.log_softmax(logits[:, -1, :].float() / self.temperature, dim=-1)
        self._latest_sampling = None

    def _observe_sampling(self, scores: torch.Tensor) -> None:
        self._latest_sampling = torch.log_softmax(scores.float(), dim=-1)

    def _take(self, picked: torch.Tensor) -> None:
        """Gather the latest step's log-probs at the tokens picked from it, ``(B, 1)``."""
        self._columns.append(self._latest.gather(1, picked).squeeze(1))
        if self.sampling_observer is not None:
            sampled_from = self._latest_sampling
            if sampled_from is None or sampled_from.size(0) != picked.size(0):
                self._sampling_columns.append(torch.full_like(self._columns[-1], float("nan")))
            else:
                self._sampling_columns.append(sampled_from.to(picked.device).gather(1, picked).squeeze(1))
        self._picked.append(picked.squeeze(1))

    def finish(self, generated: torch.Tensor) -> torch.Tensor | None:
        """``(B, N)`` log-probs of the ``N`` generated tokens ``generated`` (after :meth:`close`), or ``None`` when the
        recorded steps do not line up with them (forwards that are not one per generated token: chunked prefill,
        assisted decoding, beams, a replaced ``generate``). The sampling log-probs, when recorded, are then in
        :attr:`sampling_logps`."""
        num_tokens = generated.size(1)
        self.sampling_logps = None
        if self._latest is not None and len(self._columns) < num_tokens and self._latest.size(0) == generated.size(0):
            self._take(generated[:, len(self._columns) : len(self._columns) + 1].to(self._latest.device))
        self._latest = self._latest_sampling = None
        if num_tokens == 0:
            empty = generated.new_zeros(generated.size(0), 0, dtype=torch.float32)
            self.sampling_logps = empty if self.sampling_observer is not None else None
            return empty
        if len(self._picked) < num_tokens:
            return None
        picked = torch.stack(self._picked[:num_tokens], dim=1)
        if picked.shape != generated.shape or not torch.equal(picked, generated.to(picked.device)):
            return None
        if self.sampling_observer is not None:
            sampling = torch.stack(self._sampling_columns[:num_tokens], dim=1)
            if torch.isnan(sampling).any():
                return None  # a step whose processed scores were not observed: not the decoding loop expected
            self.sampling_logps = sampling
        return torch.stack(self._columns[:num_tokens], dim=1)

    def close(self) -> None:
        self._handle.remove()


class _ProcessedScoresObserver(LogitsProcessor):
    """The last logits processor before the token is drawn: hands the processed scores to the recorder, unchanged."""

    def __init__(self, recorder: GenerationLogpsRecorder):
        self.recorder = recorder

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.recorder._observe_sampling(scores)
        return scores
