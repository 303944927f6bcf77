"""`AsyncA3POTrainer`: TRL's GRPOTrainer with a background generator and A-3PO's decoupled loss; here, its lifecycle
and TRL's hooks: ``train`` starts and always stops the batch producer (:mod:`a3po_trl.builders`), ``_prepare_inputs``
makes the producer's batches training batches (:mod:`a3po_trl.training_batch`), ``compute_loss`` is the decoupled loss
(:mod:`a3po_trl.losses`), a callback publishes the weights after every optimizer step, and checkpoints are written
whole and restored piece by piece (:mod:`a3po_trl.checkpoints`). Evaluation is GRPOTrainer's own, synchronous path
(docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import copy
import logging
import os
import textwrap
import weakref

import torch
from accelerate.utils import gather_object
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer
from trl.trainer.utils import split_tensor_dict

from .builders import RunPlan, build_backend, build_batch_producer, cpu_threads, plan_run, uses_fsdp2
from .checkpoints import resolve_resume_checkpoint, save_checkpoint_atomically
from .checkpoints.run_state import RestoredRunState, restore_run_state, save_fsdp2_model, save_run_state
from .checkpoints.saves import resumed_a_complete_run
from .config import AsyncA3POConfig, trainer_config
from .generation import BatchProducer, GenerationBackend
from .generation.cpu_threads import CPUThreads
from .generation.producer import refuse_a_second_generation_thread
from .losses import DecoupledLossMixin, LossSettings
from .metrics.deferred import resolve_metrics
from .patches import align_position_ids_with_generation
from .proximal import ProximalAnchor
from .rollout.reward_workers import RewardWorkers, start_reward_workers
from .rollout.rollout_func import generate_completions
from .runtime.distributed import ArrivalGate, destroy_process_group_at_exit, process_group_timeout, take_together
from .timeline import TRAINING_LANE, TimelineRecorder, TraceWriter, TrainingStepTimeline
from .timeline.overlap import OverlapMonitor
from .training_batch import make_training_batch
from .validation import check_supported, check_train_dataset, check_trainer, effective_generation_config

logger = logging.getLogger(__name__)


class _PublishWeightsCallback(TrainerCallback):
    """Publishes the trainer's weights to the generator after every optimizer step (version = global_step)."""

    def __init__(self, trainer: AsyncA3POTrainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._publish_weights()


class AsyncA3POTrainer(DecoupledLossMixin, GRPOTrainer):
    """GRPO with asynchronous generation and A-3PO's staleness-aware proximal policy.

    Constructed exactly like :class:`trl.GRPOTrainer` (model id or model, ``reward_funcs``, ``args``,
    ``train_dataset``, ``eval_dataset``, ``processing_class``, ``reward_processing_classes``, ``callbacks``,
    ``optimizers``, ``peft_config``), with an :class:`~a3po_trl.AsyncA3POConfig` as ``args``; a plain
    ``GRPOConfig`` is converted with :meth:`~a3po_trl.AsyncA3POConfig.from_grpo_config` (A-3PO settings at their
    defaults, with a warning).

    Reward functions run in the generation thread (in worker processes with ``reward_num_workers > 0``). They receive
    what GRPOTrainer passes (``prompts``, ``completions``, ``completion_ids``, the dataset columns, ``log_metric``,
    ``log_extra``), and as ``trainer_state`` a snapshot of the trainer state at the optimizer step whose weights
    generated the batch (the live state belongs to the training thread). ``async def`` reward functions run on TRL's
    event loop.

    Example:

    ```python
    from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer

    trainer = AsyncA3POTrainer(
        model="HuggingFaceTB/SmolLM2-135M-Instruct",
        reward_funcs=my_reward,
        args=AsyncA3POConfig(output_dir="out", max_staleness=2),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

    _tag_names = ["trl", "grpo", "a3po", "async"]
    _name = "AsyncA3PO"
    # The model card's paper (TRL's pattern): A-3PO, then GRPO's own entry, since the loss is GRPO's, decoupled.
    _paper = {
        "title": "A-3PO: Accelerating Asynchronous LLM Training with Staleness-aware Proximal Policy Approximation",
        "id": "2512.06547",
        # docstyle-ignore
        "citation": textwrap.dedent("""\
            @article{li2025a3po,
                title        = {{A-3PO: Accelerating Asynchronous LLM Training with Staleness-aware Proximal Policy Approximation}},
                author       = {Xiaocan Li and Shiliang Wu and Zheng Shen},
                year         = 2025,
                eprint       = {arXiv:2512.06547},
            }""")  # noqa: E501
        + "\n\n"
        + GRPOTrainer._paper["citation"],
    }

    def __init__(
        self, model, reward_funcs=None, args: AsyncA3POConfig | GRPOConfig | None = None, train_dataset=None, **kwargs
    ):
        args = trainer_config(args, model)
        check_supported(args, kwargs)
        check_train_dataset(train_dataset, environment_owns_prompts=kwargs.get("environment_factory") is not None)
        # vLLM is this trainer's own generation backend (generation/vllm/), driven by the generation thread:
        # GRPOTrainer must not build its synchronous one, so it is constructed as if use_vllm were off.
        self._use_vllm_backend = bool(args.use_vllm)
        args.use_vllm = False
        try:
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        finally:
            args.use_vllm = self._use_vllm_backend
        check_trainer(self)
        self._generation_config_checked = effective_generation_config(self)
        for module in (self.model, self.accelerator.unwrap_model(self.ref_model) if self.ref_model else None):
            if module is not None:
                align_position_ids_with_generation(module)
        # The accelerator initialized the process group by now; end it before interpreter exit (runtime/distributed).
        destroy_process_group_at_exit()

        self._producer: BatchProducer | None = None
        self.last_batch_producer: BatchProducer | None = None
        """The batch producer of the latest `train()` call, kept after it stops for inspection (counters, queue,
        backend)."""
        self._backend: GenerationBackend | None = None
        self._reward_workers: RewardWorkers | None = None
        """The reward worker processes of the current run (``reward_num_workers > 0``), closed with the producer."""
        self._run_start_step = 0
        self._steps_in_epoch: int | None = None
        self._batch_gate: ArrivalGate | None = None
        self._plan: RunPlan | None = None
        """The micro-steps and generation batches of the current run (see :func:`a3po_trl.builders.plan_run`)."""
        self._schedule_warned = False
        self._weight_sync_seconds = 0.0
        self._resume_checkpoint = None
        self._restored: RestoredRunState | None = None
        """What the current run took from the checkpoint it resumed from (see :func:`restore_run_state`)."""
        self._resumed_a_complete_run = False
        self._batch_order: dict | None = None
        """The batch being trained and the order of its rows (see :mod:`a3po_trl.checkpoints.batch_order`)."""
        self._checkpoint_staging_dir: str | None = None
        self.timeline = TimelineRecorder(enabled=args.timeline)
        """The spans of both threads (see :mod:`a3po_trl.timeline`), kept across `train()` calls."""
        self._trace_writer = TraceWriter(self.timeline)
        self._step_timeline = TrainingStepTimeline(self.timeline)
        self.add_callback(self._step_timeline)  # before the publication callback: a step's span ends before it
        self.add_callback(_PublishWeightsCallback(self))
        self.cpu_threads = CPUThreads(args.training_num_threads, args.generation_num_threads)
        """The intra-op thread counts of the latest ``train()`` (see :mod:`a3po_trl.generation.cpu_threads`)."""
        self.overlap_monitor = OverlapMonitor(lambda: self._producer, lambda: self.accelerator.is_main_process)
        """Says once per ``train()`` call when the generation thread's overlap costs more than it hides."""
        self.add_callback(self.overlap_monitor)
        self.loss_settings = LossSettings.of(self)
        """The loss's settings, read once (see :mod:`a3po_trl.losses`)."""
        self.proximal_anchor = ProximalAnchor.from_config(args)
        """The proximal log-probs the loss trains with, by ``prox_logp_method`` (see :mod:`a3po_trl.proximal`)."""

    # ---- batch producer --------------------------------------------------------------------------------------------
    def _unwrapped_model(self):
        return self.accelerator.unwrap_model(self.model)

    def _build_backend(self) -> GenerationBackend:
        """The generation backend: Hugging Face ``generate`` on the generator's own copy, or vLLM (``use_vllm``)."""
        return build_backend(self)

    @staticmethod
    def generate_completions(prompt_ids: list[list[int]]) -> dict[str, list]:
        """For a ``rollout_func``: generate one completion per row of ``prompt_ids`` (token ids) with the weights of
        the batch being rolled out, returning ``{"completion_ids", "logprobs"}`` (the behavior log-probs its output
        must carry). Callable only from inside a ``rollout_func`` (see :mod:`a3po_trl.rollout.rollout_func`)."""
        return generate_completions(prompt_ids)

    def set_initial_training_values(self, args, dataloader):
        # Trainer computes the loop's shape here; the batch schedule must follow the real loop (see schedule.py).
        values = super().set_initial_training_values(args, dataloader)
        self._steps_in_epoch = values[5]
        return values

    def _init_training_state(
        self, max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
    ):
        epochs_trained, steps_trained = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        self._resumed_a_complete_run = resumed_a_complete_run(
            resume_from_checkpoint, self.state.global_step, max_steps
        )
        if self._resumed_a_complete_run:  # past the last epoch, the loop runs no epoch at all
            return num_train_epochs, 0
        return epochs_trained, steps_trained

    def _generation_thread_left_behind(self) -> bool:
        """Whether the generation thread of an earlier ``train()`` call outlived its stop and is still running."""
        producer = self.last_batch_producer
        return producer is not None and producer.thread is not None and producer.thread.is_alive()

    def _start_producer(self):
        refuse_a_second_generation_thread(self._generation_thread_left_behind(), self.args.generation_stop_timeout)
        if self._backend is None:
            self._backend = self._build_backend()
            weakref.finalize(self, self._backend.close)  # an engine or a server's adapters outlive train() calls
        if self._steps_in_epoch is None:  # batches taken outside train(): the loop's shape from its dataloader
            self.set_initial_training_values(self.args, self.get_train_dataloader())
        self._plan = plan_run(self)
        self.proximal_anchor.start_run(self._plan, self._steps_in_epoch)
        self._batch_gate = ArrivalGate.of_processes(
            self.accelerator, "a3po-take-batch", self.args.generation_poll_interval, self.generation_batch_timeout
        )
        self._restored = restore_run_state(self, self._plan)
        self._reward_workers = start_reward_workers(self)  # before the producer, whose rollouts are given them
        self._producer = build_batch_producer(self, self._plan, self._restored)
        self.last_batch_producer = self._producer
        model, version = self._unwrapped_model(), self.state.global_step
        self._producer.start(model, version, self._state_snapshot(), earlier_versions=self._restored.kept_versions)

    @property
    def generation_batch_timeout(self) -> float:
        """Seconds a process waits for its next generation batch and for the others to take theirs: the config's
        ``generation_batch_timeout``, or the process group's timeout (``ddp_timeout``)."""
        if self.args.generation_batch_timeout is not None:
            return self.args.generation_batch_timeout
        return process_group_timeout(self.args.ddp_timeout)

    def _stop_producer(self) -> BaseException | None:
        """Stop and join the generation thread (and end the reward workers and a generation process). Returns the
        thread's exception that no batch request re-raised (it failed after the last batch the trainer took), if
        any."""
        workers, self._reward_workers = self._reward_workers, None
        try:
            if self._producer is None:
                return None
            producer, self._producer = self._producer, None
            return producer.shut_down(timeout=self.args.generation_stop_timeout)
        finally:
            if workers is not None:  # after the thread: a batch it is scoring finishes, or fails when they end
                workers.close(timeout=self.args.generation_stop_timeout)
            if self.args.generation_process and self._backend is not None:  # its process ends with the run
                backend, self._backend = self._backend, None
                backend.close()

    def _get_output_dir(self, trial):
        # While a checkpoint is written, transformers' save writes into its staging folder (see checkpoints/saves.py).
        return self._checkpoint_staging_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        def write():
            super(AsyncA3POTrainer, self)._save_checkpoint(model, trial)
            save_run_state(
                self, os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
            )

        with self.timeline.span(TRAINING_LANE, "save checkpoint", step=self.state.global_step):
            save_checkpoint_atomically(self, trial, write)
        self._write_trace()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """As Trainer's, and under FSDP2 whole weights (or a PEFT adapter) gathered from every process's shards
        (:func:`~a3po_trl.checkpoints.run_state.save_fsdp2_model`)."""
        if not uses_fsdp2(self):
            return super().save_model(output_dir, _internal_call)
        save_fsdp2_model(self, output_dir if output_dir is not None else self.args.output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _write_trace(self) -> str | None:
        return self._trace_writer.write(self.args.output_dir, self.accelerator.process_index)

    def save_timeline(self, path: str | None = None, last_steps: int = 20) -> str:
        """Draw the last ``last_steps`` optimizer steps of the timeline as a PNG (needs matplotlib: the ``plots``
        extra): one lane per thread, generation batches and the steps that train on them coloured by the version
        that generated them, waits hatched, and the end time a perfectly pipelined run would have reached. Returns
        the path, ``output_dir/timeline.png`` by default."""
        from .timeline.plot import draw_timeline

        if not self.timeline.enabled:
            raise ValueError("The timeline is off (timeline=False): set timeline=True in the config to record it.")
        path = path or os.path.join(self.args.output_dir, "timeline.png")
        trace = self.timeline.chrome_trace(self.accelerator.process_index)
        return draw_timeline(trace["traceEvents"], path, last_steps=last_steps)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        # The loss's metrics are device tensors until now (metrics/deferred.py): one read of the device per log.
        resolve_metrics(self._metrics["train" if self.model.training else "eval"])
        super().log(logs, start_time)

    def _state_snapshot(self):
        """A copy of the trainer state as it is now, for reward functions running beside the training thread."""
        snapshot = copy.copy(self.state)
        snapshot.log_history = list(self.state.log_history)
        return snapshot

    def _publish_weights(self):
        if self._producer is not None:
            model = self._unwrapped_model()
            with self.timeline.span(TRAINING_LANE, "publish weights", version=self.state.global_step):
                seconds = self._producer.publish(model, self.state.global_step, self._state_snapshot())
            self._weight_sync_seconds += seconds

    def train(self, *args, **kwargs):
        previous_threads = torch.get_num_threads()
        self.cpu_threads = cpu_threads(self, previous_threads)
        if self.cpu_threads.reason and self.accelerator.is_main_process:
            logger.info(
                "CPU threads: %s (training_num_threads / generation_num_threads override)", self.cpu_threads.reason
            )
        if self.cpu_threads.training is not None:
            torch.set_num_threads(self.cpu_threads.training)
        # Micro-steps are counted from the start of this run: its first one takes a new batch (see _prepare_inputs).
        self._run_start_step = self._step
        self._buffered_inputs = None
        self._batch_order = None
        self._resumed_a_complete_run = False
        self._schedule_warned = False
        try:
            alive = self._generation_thread_left_behind()
            if self.accelerator.num_processes > 1:  # every process refuses together
                alive = any(gather_object([alive]))
            refuse_a_second_generation_thread(alive, self.args.generation_stop_timeout)
            resume = resolve_resume_checkpoint(self, kwargs.get("resume_from_checkpoint", args[0] if args else None))
        except BaseException:
            torch.set_num_threads(previous_threads)
            raise
        if args:
            args = (resume, *args[1:])
        else:
            kwargs["resume_from_checkpoint"] = resume
        self._resume_checkpoint = os.fspath(resume) if isinstance(resume, (str, os.PathLike)) else None
        try:
            result = super().train(*args, **kwargs)
        except BaseException as error:
            generation_error = self._end_train(previous_threads)
            if generation_error is not None:  # logged: the error in flight is the one raised
                logger.error(
                    "The a3po generation thread failed too, while train() was failing with %r:",
                    error,
                    exc_info=(type(generation_error), generation_error, generation_error.__traceback__),
                )
            raise
        generation_error = self._end_train(previous_threads)
        if generation_error is not None:  # it failed after the last batch the trainer took: nobody saw it yet
            raise generation_error.with_traceback(generation_error.__traceback__)
        return result

    def _end_train(self, previous_threads: int) -> BaseException | None:
        """What ends every ``train()``: stop the generation thread (returning its unreported error), free what the
        proximal anchor kept, restore the thread count, write the trace. Raises nothing of its own."""
        try:
            return self._stop_producer()
        finally:
            self.proximal_anchor.end_run()
            torch.set_num_threads(previous_threads)
            if not self._resumed_a_complete_run:  # a finished run started again leaves its folder as it was
                self._write_trace()

    # ---- batches -------------------------------------------------------------------------------------------------
    def _prepare_inputs(self, generation_batch):
        if not self.model.training:
            return super()._prepare_inputs(generation_batch)
        if self._producer is None:
            self._start_producer()
        run_step, step = self._step - self._run_start_step, self.state.global_step
        micro_step, self._schedule_warned = self._plan.micro_step(run_step, step, self._schedule_warned)
        position = micro_step.position % self._plan.micro_steps_per_batch
        if position == 0 or self._buffered_inputs is None:
            with self.timeline.span(TRAINING_LANE, "take batch") as span_args:
                scored, waited = self._take_batch()
                self._step_timeline.batch_taken(scored.index, scored.version)
                planned = self._plan.batches[scored.index]
                batch = make_training_batch(self, scored, waited, planned, self._weight_sync_seconds)
                self._weight_sync_seconds = 0.0
                batch, self._batch_order = self._restored.order_rows(batch, planned)
                span_args.update(self._step_timeline.batch)
            self._buffered_inputs = split_tensor_dict(batch, self.args.steps_per_generation)
            self._restored.attach_recomputed_anchor(self, planned, self._buffered_inputs)  # resumed inside it
        self._step_timeline.inputs_ready()
        return self._buffered_inputs[position % self.args.steps_per_generation]

    def _take_batch(self):
        """The producer's next batch. The processes agree first on whether each has one (a process whose generation
        failed would otherwise leave the others in the collectives that follow), after waiting for each other outside
        any collective (a process drawing many batches can take longer than the process group's timeout)."""
        return take_together(
            self.accelerator, self._batch_gate, self._producer.get, "Taking the next generation batch"
        )
