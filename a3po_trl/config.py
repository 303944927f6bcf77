"""`AsyncA3POConfig`: TRL's `GRPOConfig` plus the settings of asynchronous generation and the A-3PO loss."""

from __future__ import annotations

import copy
import dataclasses
import logging
import pickle
from dataclasses import dataclass, field

from trl import GRPOConfig

PROXIMAL_METHODS = ("loglinear", "recompute", "metrics", "behavior", "guarded")
"""How the proximal log-probs are obtained: A-3PO's interpolation, the log-probs of the weights of the batch's first
optimizer step (``recompute``), both (``metrics``, to measure the error), not at all (``behavior``: the ablation
without a proximal policy, the trust region anchored at the behavior policy), or the interpolation checked against its
exact target every few batches with ``recompute``'s anchor while it is off by more than a budget (``guarded``,
:mod:`a3po_trl.proximal.guard`). :mod:`a3po_trl.proximal` says what each computes, and when ``recompute`` pays a
forward."""

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
            How the proximal log-probs of decoupled PPO are obtained. `"loglinear"` is A-3PO: a staleness-aware
            interpolation between the behavior and the current log-probs, no forward pass. `"recompute"` anchors at
            the weights of the batch's first optimizer step (standard decoupled PPO). Where every micro-batch of a
            generation batch is trained before that batch's first optimizer step (one optimizer step per generation
            batch: `steps_per_generation == gradient_accumulation_steps` and `num_iterations=1`, or several batches per
            step), those are the weights being trained: the training forward's own log-probs, detached, are the
            anchor, no extra forward runs, the ratio is 1, its clip never engages and only `behavior_weight_cap` bounds
            the step. With several optimizer steps per generation batch (`steps_per_generation >
            gradient_accumulation_steps` or `num_iterations > 1`) one no-grad forward over the batch computes the
            anchor when the batch is taken, and the clip acts on the micro-steps after the first optimizer step: that
            forward is the cost of `"recompute"` over `"loglinear"`. `"metrics"` anchors as `"recompute"` does, and
            also logs the error of the log-linear estimate against that anchor.
            `"behavior"` is an ablation, the loss of asynchronous trainers without a separate proximal policy (TRL's
            experimental `AsyncGRPOTrainer` computes it from its engine's log-probs): the trust region is anchored at
            the behavior policy itself, one clipped ratio `pi_theta / pi_behav` and no behavior importance weight (it
            is 1 on every token, so `behavior_weight_cap` never acts), i.e. GRPOTrainer's loss with the generating
            weights as its "old" policy, whatever their staleness. Under truncated or penalised sampling (`top_p < 1`,
            `top_k > 0`, ...) the anchor is the untruncated behavior policy and the sampler's truncation is ignored
            too, as GRPOTrainer's own `generate` path ignores it. It costs nothing. Without truncation it equals
            `"loglinear"` at staleness 0 and 1 (and GRPOTrainer at staleness 0); at larger staleness the clipped ratio
            measures the whole drift from the stale weights instead of about one step of it, so more tokens clip and
            nothing reweights them. `"guarded"` trains with `"loglinear"` and checks it: every `prox_check_interval`
            generation batches one no-grad forward per micro-step of the batch computes the log-probs of the version
            the interpolation targets (one before the trained weights), and while the interpolation's error exceeds
            `prox_error_budget` the batches train with `"recompute"`'s anchor (docs/ARCHITECTURE.md has the math).
        prox_check_interval (`int`, *optional*, defaults to `2`):
            With `prox_logp_method="guarded"`: check the interpolation on every `prox_check_interval`-th generation
            batch (batches 1, 1 + N, 1 + 2N, ... of the run). A check costs one no-grad forward over the checked batch,
            and keeps a copy of the trainable weights (the adapters with LoRA) for the optimizer steps that train it.
            The default is the oracle study's (docs/BENCHMARKS.md): the largest interval at which a check still
            decided for a later batch as that batch's own check did, within 5 points of the next batch's.
        prox_error_budget (`float`, *optional*, defaults to `1.0`):
            With `prox_logp_method="guarded"`: the largest error of the interpolation a check accepts, relative to one
            optimizer step's drift on the same tokens (mean `|interpolated - target|` over mean `|current - target|`,
            tokens of staleness >= 1). Above it the batches train with the recomputed anchor until a check is within
            it again. At 1.0 (the oracle study's rule, docs/BENCHMARKS.md) the interpolation is accepted while it is
            closer to its target than the trained weights themselves.
        behavior_weight_cap (`float` or `None`, *optional*, defaults to `5.0`):
            Cap on the behavior importance weight `pi_prox / pi_behav`. Must be greater than 1; `None` disables it.
        behavior_weight_cap_mode (`str`, *optional*, defaults to `"token_mask"`):
            How the cap applies: `"token_mask"` drops tokens above the cap, `"token_truncate"` clamps them,
            `"sequence_mask"` / `"sequence_truncate"` do the same with the geometric mean of the weight over each
            sequence.

        disable_dropout (`bool`, *optional*, defaults to `True`):
            Whether to disable dropout in the model. GRPOConfig leaves it on by default; here it is off, because the
            generator samples and scores its tokens without dropout, so dropout in the training forward would make
            the importance ratios of on-policy tokens differ from 1 (GRPOTrainer's own on-policy ratio is exactly 1:
            it compares a forward with itself). Setting it to `False` on a model with dropout logs a warning.

        > Parameters that control asynchronous generation

        max_staleness (`int` or `None`, *optional*, defaults to `None`):
            Admission control: the generator never starts a batch that would be consumed more than `max_staleness`
            optimizer steps after the weights it generates with; it waits instead, so no sample is thrown away. `0`
            is synchronous (on-policy) training. With `steps_per_generation * num_iterations` larger than
            `gradient_accumulation_steps`, one generation batch spans several optimizer steps and `max_staleness`
            must be at least that span minus one. `None` takes the span: the batch schedule plus one optimizer step
            of overlap between generation and training (`1` with GRPOConfig's defaults).
        async_generation (`bool`, *optional*, defaults to `True`):
            Generate in a background thread that overlaps with training. `False` generates in the main thread
            when a batch is needed (still versioned and scored by the same batch producer): useful for debugging and
            for bit-exact reproducibility.
        reproducible_generation (`bool`, *optional*, defaults to `False`):
            Generate every batch with exactly the weight version the staleness schedule assigns it (the oldest the
            bound allows: staleness is then exactly `max_staleness` after the first batches, less in a last batch
            that `max_steps` ends inside), instead of the newest one available when the generator starts it. Which
            weights generate a batch then no longer depends on timing, and since sampling draws from a stream seeded
            by `seed`, the process and the batch, two runs with the same seed give the same samples, losses and
            weights with the thread on (and across a checkpoint resume, also one with a larger `max_steps`: see
            docs/RELIABILITY.md). Cost: the generator keeps the published versions a later batch may still need, up
            to `max_staleness + 1` copies of the trainable weights (the adapter under LoRA; the whole model under
            full fine-tuning, e.g. 3 x 513 MiB for SmolLM2-135M in fp32 at `max_staleness=2`), a checkpoint the
            `max_staleness` versions before its step, and samples are staler on average.
        in_flight_weight_updates (`bool`, *optional*, defaults to `False`):
            Load a version the trainer publishes while a batch is being generated at the next decode step, and
            continue the batch's completions with it (as PipelineRL and prime-rl do), instead of finishing the batch
            with the weights it started with. Every completion token records the version that sampled it, and its
            behavior log-prob is the one those weights gave it; the KV cache of the earlier tokens stays as the
            earlier weights computed it (see docs/ARCHITECTURE.md: with `loglinear` at staleness `d <= 1` the gap
            between that cache and the trainer's forward enters the clipped ratio unweighted;
            `a3po/behavior_mismatch_after_switch_mean|max` measures it), and the loss stales each token by its own
            version.
            `max_staleness` still bounds every token (a sample's oldest token is its first). Supported with the
            `generate` backend (`use_vllm=False`, between decode steps), vLLM colocate with full weights (between
            engine steps) and a vLLM server with full weights (its pause with requests kept / load / resume, also when
            several training processes share it), with `behavior_logps_source="generation"` and
            `async_generation=True`; refused with LoRA on vLLM, a server without vLLM's dev-mode and token routes,
            `reproducible_generation=True` (the switch points depend on timing) and a `rollout_func`. Off by default:
            its pre-registered benchmark found no difference in step time, generator idle time, token staleness or
            accuracy at equal wall-clock (docs/BENCHMARKS.md).
        generation_device (`str` or `None`, *optional*, defaults to `None`):
            Device of the generator's copy of the weights, e.g. `"cuda:1"`. `None` uses the training device. On
            another device, frozen weights cannot be shared and are copied too.
        behavior_logps_source (`str`, *optional*, defaults to `"generation"`):
            Where the behavior log-probs come from. `"generation"` records them while generating, from the logits
            `generate` computes anyway (raw logits / `temperature`, the distribution the training log-probs score):
            no extra forward pass. `"forward"` runs one no-grad forward of the generator's weights over prompts and
            completions after generation, with the training forward's numerics (full sequence instead of KV-cache
            decoding; the two agree to float rounding in fp32, to bf16 rounding under bf16). With truncated or
            penalised sampling (`top_p < 1`, `top_k > 0`, `min_p`, `repetition_penalty`, ...), `"generation"` also
            records each token's log-prob under the processed distribution it was drawn from, the denominator of the
            behavior weight (the untruncated one stays the trust-region anchor, so an on-policy ratio is 1);
            `"forward"` cannot, and is refused with such settings. vLLM reports only the processed log-probs, so
            `use_vllm=True` refuses them.
        generation_batch_chunk_size (`int` or `None`, *optional*, defaults to `None`):
            Number of sequences per `generate` call and per behavior log-prob forward in the generator. `None`
            processes the whole local generation batch at once.
        generation_num_threads (`int` or `None`, *optional*, defaults to `None`):
            CPU only: number of intra-op threads of the generation thread (`torch.set_num_threads` inside the
            thread). `None` leaves PyTorch's setting. On a small CPU machine, one thread for generation and one for
            training lets both run side by side.
        training_num_threads (`int` or `None`, *optional*, defaults to `None`):
            CPU only: number of intra-op threads of the training (main) thread during `train()`. `None` leaves
            PyTorch's setting.
        generation_poll_interval (`float`, *optional*, defaults to `0.1`):
            Seconds between checks of the generation thread's health while the trainer waits for samples; bounds
            how late an error in the thread is noticed.
        generation_stop_timeout (`float`, *optional*, defaults to `30.0`):
            Seconds `train()` waits for the generation thread to finish when it stops (normally, on an exception or
            on KeyboardInterrupt). A running `generate` call is interrupted at the next token; a reward function that
            never returns cannot be, and the (daemon) thread is then left behind with a warning.

        > Parameters that control the vLLM backend (`use_vllm=True`; GRPOConfig's `vllm_*` fields keep their meaning)

        With several training processes (`accelerate launch`), `vllm_mode="colocate"` runs an engine in every process
        and `vllm_mode="server"` shares one server: with LoRA each process loads its own adapter per version; with
        full weights the server holds one version at a time, which the processes agree on (the first process that
        needs the next version loads it, once every process has published it and none still generates with the
        previous one). Staleness is what one process gets: the bound (`max_staleness`) and the choice of version
        (the newest published when a batch starts, or the scheduled one with `reproducible_generation`) do not
        change; what sharing adds is waiting, as a process that needs the next version waits for the other
        processes' batches of the previous one (measured with two CPU processes on SmolLM2-135M at `max_staleness=1`:
        staleness mean 1.00 as with one process, 0.7 s per 26 s step spent waiting; `benchmarks/backends.py
        --processes 2` reports both).

        weight_sync_timeout (`float`, *optional*, defaults to `300.0`):
            Seconds loading one weight version into a vLLM server may take (an adapter load, a weight reload, a cache
            reset); past it the batch fails and the error reaches `train()`, instead of a hang.
        vllm_request_timeout (`float`, *optional*, defaults to `600.0`):
            Seconds one generation request to a vLLM server may take (a whole local generation batch); past it, or
            as soon as the server cannot be reached, the batch fails and the error reaches `train()`.

        > Parameters that control multi-turn rollouts (`tools`, `environment_factory`)

        refresh_weights_between_turns (`bool`, *optional*, defaults to `True`):
            Whether the generator loads the newest published weights between the turns of a trajectory (after the
            tool results of a turn are in, before the model continues), so that turns generated after a slow tool
            call are less stale. Every generated token records the version that generated it, and its staleness,
            proximal log-prob and importance weight are computed token by token. `False` generates every turn of a
            batch with the weights its first turn used. Ignored with `reproducible_generation=True` (the batch's
            assigned version generates every turn, so runs stay reproducible).
        tool_call_timeout (`float` or `None`, *optional*, defaults to `None`):
            Seconds one tool call may take. Past it the model sees the tool-error message `{"error": "..."}` (as
            for a tool that raises, TRL's behaviour) and the call counts as a failure and a timeout; the call is left
            running in a daemon thread. With a timeout, synchronous tools run in a worker thread (so objects a tool
            uses must not be bound to the thread that created them). `None` runs tools in the generation thread with
            no limit, as GRPOTrainer does: a tool that never returns then stalls training.

        > Parameters that control dynamic sampling (DAPO's; verl's `filter_groups`)

        dynamic_sampling (`bool`, *optional*, defaults to `False`):
            Train only on groups that carry a reward signal: the generation thread drops the groups the filter rejects
            (by default those whose advantages are all 0: the rewards they are computed from, the weighted sum, or the
            weighted sum of the per-function normalised rewards under
            `multi_objective_aggregation="normalize_then_sum"`, do not vary within the group) and draws further
            generation batches (new prompts, with the newest published weights; exactly the batch's version with
            `reproducible_generation=True`) until each process's batch is full of groups that pass, at most
            `dynamic_sampling_max_gen_batches` per training batch; the surplus of the last draw is discarded. At that
            bound the batch is completed with the flat groups drawn last, with a warning and the
            `a3po/dynamic_sampling_bound_reached` metric. `scale_rewards="batch"` and the loss normalisation are
            computed over the groups kept. The prompt stream's epochs count the prompts drawn, not those trained
            (`num_train_epochs` still sets the optimizer steps).
        dynamic_sampling_filter (`str`, callable or `None`, *optional*, defaults to `None`):
            Which groups dynamic sampling keeps: `None` keeps those whose advantages are not all 0 (the weighted reward
            sum, or with `multi_objective_aggregation="normalize_then_sum"` the weighted sum of the per-function
            normalised rewards, has a non-zero standard deviation in the group); otherwise a function `keep(rewards) ->
            bool` of a group's `(num_generations, num_reward_funcs)` raw rewards (NaN where a reward function returned
            None), or its dotted import path (`my_module.keep_group`, e.g. on the command line). A function must be
            defined at module level (the config is saved with every checkpoint).
        dynamic_sampling_max_gen_batches (`int`, *optional*, defaults to `10`):
            Most generation batches a process draws for one training batch with dynamic sampling (verl's
            `max_num_gen_batches`); at least 1.

        > Parameters that control monitoring

        timeline (`bool`, *optional*, defaults to `True`):
            Record the spans of the generation thread and of the training thread on one clock (each generation
            batch: waiting for the staleness bound or for queue room, weight loads, generation, behavior log-probs,
            rewards, tool calls; each optimizer step: waiting for a batch, forward/backward, a recompute forward,
            the optimizer step, weight publication) and write them as a Chrome trace to
            `output_dir/timeline/trace-rank{k}.json` (one per process, `trace-rank{k}-run{r}.json` for a later run
            in the same folder; open it in Perfetto or `chrome://tracing`) at every checkpoint and at the end of
            `train()`, best effort (a failed write is a warning). `trainer.save_timeline()` draws the last steps as a
            PNG. Memory is bounded (the newest 50,000 spans) and the cost is about 2 microseconds per span, about 12
            spans per optimizer step.
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
        metadata={"help": "prox_logp_method='guarded': check the interpolation every this many generation batches."},
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
        metadata={"help": "CPU intra-op threads of the generation thread; None leaves PyTorch's setting."},
    )
    training_num_threads: int | None = field(
        default=None,
        metadata={"help": "CPU intra-op threads of the training thread during train(); None leaves it unchanged."},
    )
    generation_poll_interval: float = field(
        default=0.1,
        metadata={"help": "Seconds between health checks of the generation thread while waiting for samples."},
    )

    generation_stop_timeout: float = field(
        default=30.0,
        metadata={"help": "Seconds train() waits for the generation thread to stop on exit."},
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
        timeouts = ("generation_stop_timeout", "weight_sync_timeout", "vllm_request_timeout")
        for name in ("generation_poll_interval", *timeouts):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be a positive number of seconds.")
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

        The obvious copies (``AsyncA3POConfig(**config.to_dict())``, ``dataclasses.fields``) fail because
        ``GRPOConfig.__post_init__`` fills in whichever of ``generation_batch_size`` / ``steps_per_generation`` was
        left unset, and the two may not both be given. The schedule is carried as ``steps_per_generation`` (it gives
        back the same ``generation_batch_size`` in the same process group); an override of either replaces it. Every
        other value the post-init derived (``bf16`` from ``fp16``, ``eval_steps`` from ``logging_steps``,
        ``scale_rewards=True`` as ``"group"``, ...) is carried as derived, which derives the same again.

        A-3PO fields that ``config`` does not have take their defaults. ``disable_dropout`` is a ``GRPOConfig`` field,
        so it keeps ``config``'s value (``False`` by default there, ``True`` by default here): pass
        ``disable_dropout=True`` to get this trainer's default.
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
