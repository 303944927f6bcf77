"""`AsyncA3POConfig`: TRL's `GRPOConfig` plus the settings of asynchronous generation and the A-3PO loss."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
from dataclasses import dataclass, field

from trl import GRPOConfig

PROXIMAL_METHODS = ("loglinear", "recompute", "metrics", "behavior", "guarded")
"""The values of ``prox_logp_method``: how the proximal log-probs are obtained (:mod:`a3po_trl.proximal` says what
each computes)."""

CAP_MODES = ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate")
"""How the behavior importance weight is capped: per token or per sequence (geometric mean), masked or clamped."""

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
"""TRL's GRPOTrainer loss types, each of which the decoupled loss has a form of."""


#: Where the behavior log-probs can come from (``AsyncA3POConfig.behavior_logps_source``).
BEHAVIOR_LOGPS_SOURCES = ("generation", "forward")

logger = logging.getLogger(__name__)


@dataclass
class AsyncA3POConfig(GRPOConfig):
    r"""
    Configuration class for the [`AsyncA3POTrainer`].

    It extends TRL's [`~trl.GRPOConfig`]: every GRPO setting keeps its meaning (`loss_type`, `beta`, `epsilon`,
    `epsilon_high`, `scale_rewards`, `reward_weights`, `num_generations`, `steps_per_generation`, ...). Only the
    parameters specific to asynchronous generation and to A-3PO are listed here. A `GRPOConfig` object (from
    `TrlParser` or a recipe) converts with [`AsyncA3POConfig.from_grpo_config`], and the trainer accepts one as it is.

    Parameters:
        > Parameters that control the proximal policy and the decoupled loss

        prox_logp_method (`str`, *optional*, defaults to `"loglinear"`):
            How the proximal log-probs of decoupled PPO are obtained: `"loglinear"` (A-3PO's staleness-aware
            interpolation, no forward), `"recompute"` (the weights of the batch's first optimizer step: a no-grad
            forward per batch only where it spans several optimizer steps), `"metrics"` (as `"recompute"`, logging the
            interpolation's error), `"behavior"` (ablation: the behavior policy as anchor, no behavior weight) or
            `"guarded"` (`"loglinear"`, checked every `prox_check_interval` batches, `"recompute"`'s anchor while its
            error exceeds `prox_error_budget`). See docs/ARCHITECTURE.md#the-settings-in-full.
        prox_check_interval (`int`, *optional*, defaults to `2`):
            With `prox_logp_method="guarded"`: check the interpolation on batches 1, 1 + N, 1 + 2N, ... (one no-grad
            forward over the batch, with its dropout masks the training forward's; and a copy of the trainable weights
            on the training device: at 7B, 14 GB per GPU in bf16, 28 GB for float32 weights, divided by the processes
            under FSDP2/ZeRO-3, the adapters only with LoRA; see docs/GPU.md). The default is the oracle study's.
        prox_error_budget (`float`, *optional*, defaults to `1.0`):
            With `prox_logp_method="guarded"`: the largest error of the interpolation a check accepts, relative to one
            optimizer step's drift on the same tokens; above it the batches train with the recomputed anchor until a
            check is within it again. 1.0 accepts it while closer to its target than the trained weights. A check
            whose optimizer step moved none of its tokens (drift 0) decides nothing.
        behavior_weight_cap (`float` or `None`, *optional*, defaults to `5.0`):
            Cap on the behavior importance weight `pi_prox / pi_behav`, above 1; `None` disables it.
        behavior_weight_cap_mode (`str`, *optional*, defaults to `"token_mask"`):
            How the cap applies: `"token_mask"` drops tokens above it, `"token_truncate"` clamps them, and
            `"sequence_mask"` / `"sequence_truncate"` do so with the weight's geometric mean over each sequence.

        disable_dropout (`bool`, *optional*, defaults to `True`):
            Whether to disable dropout in the model (`False` in GRPOConfig): the generator samples without it, so
            dropout in training would make on-policy importance ratios differ from 1 (`False` warns).

        > Parameters that control asynchronous generation

        max_staleness (`int` or `None`, *optional*, defaults to `None`):
            The largest gap, in optimizer steps, between the weights that generate a sample and those that train on it
            (the generator waits; nothing is thrown away). `0` is synchronous; at least the optimizer steps a batch
            spans minus one; `None` takes that span (`1` with GRPOConfig's defaults).
        async_generation (`bool`, *optional*, defaults to `True`):
            Generate in a background thread that overlaps with training. `False` generates in the main thread when a
            batch is needed (versioned and scored the same way): for debugging and bit-exact reproducibility.
        reproducible_generation (`bool`, *optional*, defaults to `False`):
            Generate every batch with exactly the weight version the staleness schedule assigns it instead of the
            newest available: two runs with the same seed give the same samples, losses and weights, also across a
            resume. Keeps up to `max_staleness + 1` copies of the trainable weights. See
            docs/ARCHITECTURE.md#the-settings-in-full.
        in_flight_weight_updates (`bool`, *optional*, defaults to `False`):
            Load a version published while a batch is being generated at the next decode (or engine) step and continue
            the batch with it; every token records the version that sampled it and is staled by it. `generate`, vLLM
            colocate or server with full weights; off by default (its benchmark found no difference). See
            docs/ARCHITECTURE.md#in-flight-weight-updates.
        generation_device (`str` or `None`, *optional*, defaults to `None`):
            Device of the generator's copy of the weights, e.g. `"cuda:1"`; `None` uses the training device.
        behavior_logps_source (`str`, *optional*, defaults to `"generation"`):
            Where the behavior log-probs come from: `"generation"` records them while generating (no extra forward;
            also the processed distribution's under truncated or penalised sampling), `"forward"` runs one no-grad
            forward after generation (refused with such sampling). See docs/ARCHITECTURE.md#the-settings-in-full.
        generation_batch_chunk_size (`int` or `None`, *optional*, defaults to `None`):
            Sequences per `generate` call and per behavior log-prob forward; `None`: the whole local batch at once.
        generation_num_threads (`int` or `None`, *optional*, defaults to `None`):
            CPU only: intra-op threads of the generation thread, or of the generation process with
            `generation_process` (`torch.set_num_threads`). With both counts `None`, `train()` chooses from the model
            and logs it (docs/USAGE.md#cpu-threads).
        training_num_threads (`int` or `None`, *optional*, defaults to `None`):
            CPU only: intra-op threads of the training thread during `train()`; `None`: see `generation_num_threads`.
        generation_process (`bool`, *optional*, defaults to `False`):
            CPU only: run the `generate` backend in a spawned process of its own, off the trainer's interpreter (the
            generation thread stays as the coordinator; the process samples what the thread would, bit for bit). It
            holds a second copy of the model and starts in seconds. Refused with vLLM, continuous batching,
            `in_flight_weight_updates`, multi-turn rollouts, sharded weights and on a GPU. See
            docs/USAGE.md#generation-in-a-process-of-its-own.
        generation_poll_interval (`float`, *optional*, defaults to `0.1`):
            Seconds between checks of the generation thread's health while the trainer waits for samples.
        generation_stop_timeout (`float`, *optional*, defaults to `30.0`):
            Seconds `train()` waits for the generation thread to stop; a thread still running is left with a warning.
        reward_num_workers (`int`, *optional*, defaults to `0`):
            Worker processes that call the plain and `async def` reward functions, off the trainer's interpreter (a
            CPU-heavy pure-Python reward then does not stall the training thread); reward models stay in the trainer.
            Each function must be defined at the top level of an importable module. `0`: they run in the generation
            thread. See docs/USAGE.md#rewards-in-worker-processes.
        generation_batch_timeout (`float` or `None`, *optional*, defaults to `None`):
            Seconds a process waits for its next generation batch, and then for every process to have taken theirs,
            before the run fails on every process with an error naming the process that did not arrive and what its
            generation thread was doing (a reward function, a tool or a vLLM server that does not return, or a
            process that died). `None`: the process group's timeout (`ddp_timeout`, 1800 s by default). Raise it when
            a process's generation is only slow (dynamic sampling drawing many batches). See
            docs/RELIABILITY.md#a-process-that-stops-arriving.

        > Parameters that control the vLLM backend (`use_vllm=True`; GRPOConfig's `vllm_*` fields keep their meaning)

        weight_sync_timeout (`float`, *optional*, defaults to `300.0`):
            Seconds loading one weight version into a vLLM server may take before the batch fails (not hangs).
        vllm_request_timeout (`float`, *optional*, defaults to `600.0`):
            Seconds one generation request to a vLLM server may take; past it, or unreachable, the batch fails.

        > Parameters that control multi-turn rollouts (`tools`, `environment_factory`)

        refresh_weights_between_turns (`bool`, *optional*, defaults to `True`):
            Whether the generator loads the newest published weights between the turns of a trajectory, so that turns
            generated after a slow tool call are less stale (every token records its version). Ignored with
            `reproducible_generation=True`.
        tool_call_timeout (`float` or `None`, *optional*, defaults to `None`):
            Seconds one tool call may take; past it the model sees a tool-error message and the call is left running
            in a daemon thread. `None`: no limit, tools run in the generation thread as in GRPOTrainer. See
            docs/ARCHITECTURE.md#the-settings-in-full.

        > Parameters that control dynamic sampling (DAPO's; verl's `filter_groups`)

        dynamic_sampling (`bool`, *optional*, defaults to `False`):
            Train only on groups that carry a reward signal: drop the groups the filter rejects (by default those
            whose advantages are all 0) and draw further generation batches until each process's batch is full, at
            most `dynamic_sampling_max_gen_batches` per training batch. See docs/ARCHITECTURE.md#the-settings-in-full.
        dynamic_sampling_filter (`str`, callable or `None`, *optional*, defaults to `None`):
            Which groups dynamic sampling keeps: `None` those whose advantages are not all 0; otherwise a module-level
            function `keep(rewards) -> bool` of a group's `(num_generations, num_reward_funcs)` raw rewards (NaN where
            a reward function returned None), or its dotted import path.
        dynamic_sampling_max_gen_batches (`int`, *optional*, defaults to `10`):
            Most generation batches a process draws for one training batch with dynamic sampling (verl's
            `max_num_gen_batches`); at least 1.

        > Parameters that control monitoring

        timeline (`bool`, *optional*, defaults to `True`):
            Record both threads' spans and write them as a Chrome trace to `output_dir/timeline/trace-rank{k}.json`
            (`trainer.save_timeline()` draws them). See docs/ARCHITECTURE.md#the-settings-in-full.
    """

    prox_logp_method: str = field(
        default="loglinear",
        metadata={
            "help": "How the proximal log-probs are obtained: 'loglinear' (A-3PO interpolation, no forward pass), "
            "'recompute' (the weights of the batch's first optimizer step: a no-grad forward per batch only when "
            "it spans several optimizer steps), 'metrics' (recompute and log the loglinear error), "
            "'behavior' (ablation: the behavior policy as anchor, no behavior weight) or 'guarded' (loglinear, "
            "checked every prox_check_interval batches, recompute while its error exceeds prox_error_budget).",
            "choices": list(PROXIMAL_METHODS),
        },
    )
    prox_check_interval: int = field(
        default=2,
        metadata={
            "help": "prox_logp_method='guarded': check the interpolation every this many generation batches (each "
            "check keeps a copy of the trainable weights: 14 GB per GPU at 7B in bf16, divided by the processes under "
            "FSDP2/ZeRO-3, the adapters with LoRA)."
        },
    )
    prox_error_budget: float = field(
        default=1.0,
        metadata={
            "help": "prox_logp_method='guarded': the interpolation's largest accepted error, over one optimizer "
            "step's drift; above it the batches train with the recomputed anchor."
        },
    )
    behavior_weight_cap: float | None = field(
        default=5.0,
        metadata={"help": "Cap on the behavior importance weight pi_prox / pi_behav (> 1); None disables it."},
    )
    behavior_weight_cap_mode: str = field(
        default="token_mask",
        metadata={
            "help": "How the behavior weight cap applies: token_mask, token_truncate, sequence_mask, "
            "sequence_truncate.",
            "choices": list(CAP_MODES),
        },
    )
    disable_dropout: bool = field(
        default=True,
        metadata={
            "help": "Whether to disable dropout in the model (True here, False in GRPOConfig: the generator samples "
            "and scores without dropout, so dropout in training would bias on-policy importance ratios)."
        },
    )
    max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Largest allowed gap, in optimizer steps, between the weights that generate a sample and the "
            "weights that train on it. 0 is synchronous training; None allows the batch schedule plus one step of "
            "overlap."
        },
    )
    async_generation: bool = field(
        default=True,
        metadata={"help": "Generate in a background thread overlapping with training (False: in the main thread)."},
    )
    reproducible_generation: bool = field(
        default=False,
        metadata={
            "help": "Generate each batch with exactly the version the staleness schedule assigns it (reproducible "
            "runs with the thread on; keeps up to max_staleness + 1 versions of the trainable weights)."
        },
    )
    in_flight_weight_updates: bool = field(
        default=False,
        metadata={
            "help": "Load a version published while a batch is being generated at the next decode step and continue "
            "the batch with it; every token records the version that sampled it (generate backend; vLLM colocate or "
            "server with full weights)."
        },
    )
    generation_device: str | None = field(
        default=None,
        metadata={"help": "Device of the generator's weights (e.g. 'cuda:1'); None uses the training device."},
    )
    behavior_logps_source: str = field(
        default="generation",
        metadata={
            "help": "Where the behavior log-probs come from: 'generation' (recorded while generating, no extra "
            "forward) or 'forward' (one no-grad forward over prompts and completions after generation).",
            "choices": list(BEHAVIOR_LOGPS_SOURCES),
        },
    )
    generation_batch_chunk_size: int | None = field(
        default=None,
        metadata={"help": "Sequences per generate call in the generator; None processes the whole batch at once."},
    )
    generation_num_threads: int | None = field(
        default=None,
        metadata={
            "help": "CPU intra-op threads of the generation thread (or process); None: chosen from the model (logged)."
        },
    )
    training_num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU intra-op threads of the training thread during train(); None: chosen (logged)."},
    )
    generation_process: bool = field(
        default=False,
        metadata={
            "help": "CPU only: run the generate backend in a process of its own (off the trainer's interpreter); the "
            "generation thread coordinates it."
        },
    )
    generation_poll_interval: float = field(
        default=0.1,
        metadata={"help": "Seconds between health checks of the generation thread while waiting for samples."},
    )
    generation_stop_timeout: float = field(
        default=30.0,
        metadata={"help": "Seconds train() waits for the generation thread to stop on exit."},
    )
    reward_num_workers: int = field(
        default=0,
        metadata={
            "help": "Worker processes that call the reward functions (not reward models); 0: the generation thread."
        },
    )
    generation_batch_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds a process waits for its next generation batch and for every process to take theirs "
            "before the run fails naming the late process; None: the process group's timeout (ddp_timeout)."
        },
    )
    weight_sync_timeout: float = field(
        default=300.0,
        metadata={"help": "Seconds loading one weight version into a vLLM server may take before the run fails."},
    )
    vllm_request_timeout: float = field(
        default=600.0,
        metadata={"help": "Seconds one generation request to a vLLM server may take before the run fails."},
    )
    refresh_weights_between_turns: bool = field(
        default=True,
        metadata={
            "help": "Load the newest published weights between the turns of a multi-turn trajectory (every token "
            "records its version); ignored with reproducible_generation=True."
        },
    )
    tool_call_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Seconds one tool call may take before the model sees a tool-error message instead; None: no "
            "limit (tools then run in the generation thread, as in GRPOTrainer)."
        },
    )

    dynamic_sampling: bool = field(
        default=False,
        metadata={
            "help": "Train only on groups with a reward signal: drop groups the filter rejects (by default, those "
            "whose advantages are all 0) and draw more generation batches until the batch is full, at most "
            "dynamic_sampling_max_gen_batches per training batch."
        },
    )
    dynamic_sampling_filter: str | None = field(
        default=None,
        metadata={
            "help": "Which groups dynamic sampling keeps: None (those whose advantages are not all 0), or a "
            "function keep(rewards) -> bool of a group's (num_generations, num_reward_funcs) rewards, or its dotted "
            "import path."
        },
    )
    dynamic_sampling_max_gen_batches: int = field(
        default=10,
        metadata={"help": "Most generation batches drawn per training batch with dynamic sampling (>= 1)."},
    )

    timeline: bool = field(
        default=True,
        metadata={
            "help": "Record both threads' spans and write them as a Chrome trace to "
            "output_dir/timeline/trace-rank{k}.json (Perfetto, chrome://tracing)."
        },
    )

    def __post_init__(self):
        # Which batch-schedule setting the user gave, to name it in errors (GRPOConfig fills in the other).
        schedule_setting = (
            "generation_batch_size" if self.generation_batch_size is not None else "steps_per_generation"
        )
        super().__post_init__()
        self._check_generation_kwargs_temperature()
        if self.prox_logp_method not in PROXIMAL_METHODS:
            raise ValueError(
                f"prox_logp_method={self.prox_logp_method!r} is not supported; set it to one of {PROXIMAL_METHODS}."
            )
        if self.prox_check_interval < 1:
            raise ValueError(
                f"prox_check_interval={self.prox_check_interval} must be at least 1 (check every that many generation "
                "batches)."
            )
        if not self.prox_error_budget > 0:
            raise ValueError(
                f"prox_error_budget={self.prox_error_budget} must be above 0 (the interpolation's accepted error over "
                "one optimizer step's drift; 1.0 accepts it while closer to its target than the trained weights)."
            )
        if self.behavior_weight_cap_mode not in CAP_MODES:
            raise ValueError(
                f"behavior_weight_cap_mode={self.behavior_weight_cap_mode!r} is not supported; set it to one of "
                f"{CAP_MODES}."
            )
        if self.behavior_weight_cap is not None and not self.behavior_weight_cap > 1.0:
            raise ValueError(
                f"behavior_weight_cap={self.behavior_weight_cap} must be greater than 1 (the on-policy weight is 1); "
                "use e.g. 5.0, or None to disable the cap."
            )
        if self.behavior_logps_source not in BEHAVIOR_LOGPS_SOURCES:
            raise ValueError(
                f"behavior_logps_source={self.behavior_logps_source!r} is not supported; set it to 'generation' "
                "(recorded while generating) or 'forward' (one extra forward after generation)."
            )
        for name in ("generation_num_threads", "training_num_threads", "generation_batch_chunk_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be a positive integer or None.")
        if isinstance(self.reward_num_workers, bool) or not isinstance(self.reward_num_workers, int):
            raise ValueError(f"reward_num_workers={self.reward_num_workers!r} must be an integer (0: no workers).")
        if self.reward_num_workers < 0:
            raise ValueError(
                f"reward_num_workers={self.reward_num_workers} must be 0 (rewards in the generation thread) or a "
                "positive number of worker processes."
            )
        self._check_generation_process()
        timeouts = ("generation_stop_timeout", "weight_sync_timeout", "vllm_request_timeout")
        for name in ("generation_poll_interval", *timeouts):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive number of seconds.")
        if self.generation_batch_timeout is not None and not self.generation_batch_timeout > 0:
            raise ValueError(
                f"generation_batch_timeout={self.generation_batch_timeout} must be a positive number of seconds, or "
                "None (the process group's timeout, ddp_timeout)."
            )
        if self.tool_call_timeout is not None and not self.tool_call_timeout > 0:
            raise ValueError(
                f"tool_call_timeout={self.tool_call_timeout} must be a positive number of seconds, or None (no limit)."
            )
        self._check_dynamic_sampling()
        local_batch = self.per_device_train_batch_size * self.steps_per_generation
        if local_batch % self.num_generations:
            raise ValueError(
                f"Each process must generate whole groups: per_device_train_batch_size "
                f"({self.per_device_train_batch_size}) * steps_per_generation ({self.steps_per_generation}) = "
                f"{local_batch} is not a multiple of num_generations ({self.num_generations}). Change one of them "
                "so the product is a multiple of num_generations."
            )
        span = self.versions_spanned_per_generation_batch
        if self.max_staleness is None:
            # the span - 1 steps the schedule needs, plus one so that generation overlaps training
            self.max_staleness = span
        elif isinstance(self.max_staleness, bool) or not isinstance(self.max_staleness, int) or self.max_staleness < 0:
            raise ValueError(
                f"max_staleness={self.max_staleness!r} must be an integer >= 0 (0 = synchronous training, "
                "1 = generate the next batch while training on the current one), or None to derive it from the batch "
                "schedule."
            )
        elif self.max_staleness < span - 1:
            raise ValueError(
                f"max_staleness={self.max_staleness} is too small: with {schedule_setting}="
                f"{getattr(self, schedule_setting)}, num_iterations={self.num_iterations} and "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}, one generation batch is trained on "
                f"over {span} optimizer steps, so its samples reach staleness {span - 1}. Set max_staleness >= "
                f"{span - 1} (or leave it unset to get {span}), or lower {schedule_setting} / num_iterations."
            )

    @classmethod
    def from_grpo_config(cls, config: GRPOConfig, **overrides) -> AsyncA3POConfig:
        """An ``AsyncA3POConfig`` with every setting of ``config`` (a ``GRPOConfig``, e.g. from ``TrlParser`` or a
        recipe), plus ``overrides`` (any ``AsyncA3POConfig`` field, typically the A-3PO ones: ``max_staleness=2``).
        A-3PO fields that ``config`` does not have take their defaults; ``disable_dropout`` keeps ``config``'s value
        (pass ``disable_dropout=True`` for this trainer's default). How it copies: docs/ARCHITECTURE.md.
        """
        if not isinstance(config, GRPOConfig):
            raise TypeError(
                f"from_grpo_config needs a trl.GRPOConfig, got {type(config).__name__}; build an AsyncA3POConfig "
                "from keyword arguments instead: AsyncA3POConfig(output_dir=..., ...)."
            )
        settable = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(overrides) - settable)
        if unknown:
            raise TypeError(
                f"from_grpo_config got settings AsyncA3POConfig does not have: {unknown}. Check their spelling "
                "against the AsyncA3POConfig and GRPOConfig fields."
            )
        # Plain data (dicts, lists) is copied: TrainingArguments.__post_init__ edits some of it in place.
        values = {}
        for f in dataclasses.fields(config):
            if f.init and f.name in settable:
                value = getattr(config, f.name)
                values[f.name] = copy.deepcopy(value) if isinstance(value, (dict, list)) else value
        schedule = ("generation_batch_size", "steps_per_generation")
        if any(name in overrides for name in schedule):
            for name in schedule:
                values.pop(name)
        else:
            values["generation_batch_size"] = None
        return cls(**{**values, **overrides})

    def to_dict(self):
        """As ``TrainingArguments.to_dict`` (what loggers and ``to_json_string`` write), with a
        ``dynamic_sampling_filter`` function written as its import path."""
        values = super().to_dict()
        custom = values.get("dynamic_sampling_filter")
        if callable(custom):
            values["dynamic_sampling_filter"] = f"{custom.__module__}.{custom.__qualname__}"
        return values

    def _check_generation_process(self):
        """Refuse ``generation_process`` with what it is not built for (the devices are checked by the trainer)."""
        if not self.generation_process:
            return
        refused = [
            name
            for name in ("use_vllm", "use_transformers_continuous_batching", "in_flight_weight_updates")
            if getattr(self, name, False)
        ]
        if refused:
            raise ValueError(
                f"generation_process=True runs the generate backend in a process of its own, which is not built for "
                f"{', '.join(f'{name}=True' for name in refused)} yet. Set generation_process=False, or those to "
                "False."
            )

    def _check_dynamic_sampling(self):
        value = self.dynamic_sampling_max_gen_batches
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(
                f"dynamic_sampling_max_gen_batches={value!r} must be an integer >= 1 (the most generation batches "
                "drawn to fill one training batch with dynamic sampling; 10 by default, as verl's "
                "max_num_gen_batches)."
            )
        custom = self.dynamic_sampling_filter
        if custom is None or isinstance(custom, str):
            return
        if not callable(custom):
            raise ValueError(
                f"dynamic_sampling_filter={custom!r} must be None, a function keep(rewards) -> bool, or the dotted "
                "import path of one."
            )
        try:
            pickle.dumps(custom)
        except Exception as error:
            raise ValueError(
                f"dynamic_sampling_filter={custom!r} cannot be saved with a checkpoint ({error}): define the "
                "function at module level (not a lambda or a nested function), or give its dotted import path."
            ) from error

    def _check_generation_kwargs_temperature(self):
        """``generation_kwargs`` override the sampling settings, so a temperature there is the one ``generate``
        samples with, while the behavior and training log-probs are scaled by ``temperature``: the importance ratios
        would compare two distributions. Checked here, from the arguments alone, so it fails before any model loads
        (the trainer checks the model's own ``generation_config`` once it is loaded)."""
        if "temperature" not in (self.generation_kwargs or {}):
            return
        value = self.generation_kwargs["temperature"]
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if is_number and abs(value - self.temperature) <= 1e-12:
            return
        fix = (
            f"Set temperature={value} in the config instead of in generation_kwargs."
            if is_number
            else "Remove 'temperature' from generation_kwargs and set it in the config."
        )
        raise ValueError(
            f"generation_kwargs sets temperature={value!r}, but the behavior and training log-probs are scaled by "
            f"temperature={self.temperature}: they would score another distribution than the one sampled. {fix}"
        )

    @property
    def versions_spanned_per_generation_batch(self) -> int:
        """Largest number of distinct policy versions that train on one generation batch."""
        return largest_version_span(self.steps_per_generation * self.num_iterations, self.gradient_accumulation_steps)


def largest_version_span(micro_steps_per_batch: int, gradient_accumulation_steps: int) -> int:
    """Largest number of versions that train on one generation batch, over every alignment of batches and
    accumulation windows that the loop can produce (both restart at each epoch, so a batch starts at a multiple of
    ``micro_steps_per_batch`` counted from a window boundary). A shorter last window of an epoch only truncates a
    window, so it never makes a batch span more versions."""
    every, accumulation = micro_steps_per_batch, gradient_accumulation_steps
    return max(((j + 1) * every - 1) // accumulation - (j * every) // accumulation + 1 for j in range(accumulation))


def trainer_config(args, model) -> AsyncA3POConfig:
    """The trainer's ``args`` as an ``AsyncA3POConfig``: as given, GRPOTrainer's default for ``None`` (an output
    directory named after the model), or converted from a plain ``GRPOConfig`` (what ``TrlParser`` or a recipe hands
    over) with the A-3PO settings at their defaults, saying so once, since ``trainer.args`` is then a new object."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path
        return AsyncA3POConfig(f"{str(name).split('/')[-1]}-A3PO")
    if isinstance(args, AsyncA3POConfig):
        return args
    if isinstance(args, GRPOConfig):
        converted = AsyncA3POConfig.from_grpo_config(args)
        logger.warning(
            "args is a GRPOConfig: converted with AsyncA3POConfig.from_grpo_config(args), every GRPO setting kept "
            "(disable_dropout=%s included) and the A-3PO settings at their defaults (prox_logp_method=%r, "
            "max_staleness=%s, behavior_weight_cap=%s). To choose them, pass "
            "AsyncA3POConfig.from_grpo_config(args, max_staleness=..., ...) as args.",
            converted.disable_dropout,
            converted.prox_logp_method,
            converted.max_staleness,
            converted.behavior_weight_cap,
        )
        return converted
    raise TypeError(
        f"AsyncA3POTrainer needs `args` to be an AsyncA3POConfig or a trl.GRPOConfig, got {type(args).__name__}. "
        "Build an AsyncA3POConfig with the same keyword arguments (AsyncA3POConfig(output_dir=..., ...)), or convert "
        "a GRPOConfig with AsyncA3POConfig.from_grpo_config(config)."
    )
