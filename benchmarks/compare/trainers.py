"""One configuration's model, data, rewards, training arguments and trainer, built inside the worker subprocess.

``trl`` runs TRL's ``GRPOTrainer`` with timing of its generation and reward calls added; every other kind runs
``AsyncA3POTrainer``. torch, transformers and trl are imported inside the functions.
"""

from __future__ import annotations

import time

from .plan import model_key


def load_model_and_tokenizer(common):
    import torch

    if common["model"] == "tiny":
        from a3po_trl.tasks.tiny_model import make_byte_tokenizer, make_tiny_llama

        tokenizer = make_byte_tokenizer()
        model = make_tiny_llama(tokenizer, seed=0)  # deterministic: the same weights in every configuration
        return model, tokenizer, "tiny (a3po_trl.tasks.tiny_model: random 2-layer Llama, hidden 32, byte tokenizer)"
    from transformers import AutoModelForCausalLM, AutoTokenizer

    name = common["model"]
    if model_key(name) == "smollm2":
        from a3po_trl.tasks.offline_model import resolve_model_path

        name = resolve_model_path("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32)
    return model, tokenizer, str(name)


def arithmetic_dataset(common):
    from a3po_trl.tasks import generate_arithmetic_problems

    kwargs = {"system_prompt": None} if common["model"] == "tiny" else {}  # short prompts for the byte tokenizer
    return generate_arithmetic_problems(common["num_prompts"], common["difficulty"], seed=0, **kwargs)


def reward_functions(common):
    from a3po_trl.tasks.rewards import correctness_reward, format_reward

    funcs = [correctness_reward, format_reward]
    if common["model"] == "tiny":
        from a3po_trl.tasks.tiny_model import digit_reward  # dense: the random tiny model gets non-zero advantages

        funcs.append(digit_reward)
    return funcs


def _training_args(config, common, output_dir):
    kwargs = dict(
        output_dir=output_dir,
        per_device_train_batch_size=common["batch_size"],
        num_generations=common["num_generations"],
        max_completion_length=common["max_completion_length"],
        max_steps=common["steps"],
        learning_rate=common["learning_rate"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        bf16=common["bf16"],  # GRPOConfig defaults to bf16=True, which means slow bf16 autocast on most CPUs
        use_cpu=common["device"] == "cpu",
        seed=config["seed"],
        temperature=1.0,
        beta=0.0,
    )
    if config["kind"] == "trl":
        from trl import GRPOConfig

        return GRPOConfig(**kwargs)
    import torch

    from a3po_trl import AsyncA3POConfig

    generation_device = None
    if common["device"] == "cuda" and torch.cuda.device_count() > 1:
        generation_device = "cuda:1"
    threads = config.get("threads", {})
    return AsyncA3POConfig(
        **kwargs,
        prox_logp_method=config["method"],
        max_staleness=config["max_staleness"],
        async_generation=config["async_generation"],
        reproducible_generation=config.get("reproducible_generation", False),
        generation_device=generation_device,
        generation_num_threads=threads.get("generation"),
        training_num_threads=threads.get("training"),
        generation_process=config.get("generation_process", False),
    )


def _timed_grpo_trainer_class():
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's GRPOTrainer, unchanged, plus timing of its generation and reward calls (logged per step)."""

        def _generate(self, prompts):
            start = time.perf_counter()
            output = super()._generate(prompts)
            self._sync()
            self._metrics["train" if self.model.training else "eval"]["bench/generation_time"].append(
                time.perf_counter() - start
            )
            return output

        def _calculate_rewards(self, *args, **kwargs):
            start = time.perf_counter()
            output = super()._calculate_rewards(*args, **kwargs)
            self._metrics["train" if self.model.training else "eval"]["bench/reward_time"].append(
                time.perf_counter() - start
            )
            return output

        def _sync(self):
            import torch

            if self.accelerator.device.type == "cuda":
                torch.cuda.synchronize(self.accelerator.device)

    return TimedGRPOTrainer


def make_trainer(config, common, output_dir, callbacks=()):
    model, tokenizer, model_name = load_model_and_tokenizer(common)
    args = _training_args(config, common, output_dir)
    kwargs = dict(
        model=model,
        reward_funcs=reward_functions(common),
        args=args,
        train_dataset=arithmetic_dataset(common),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )
    if config["kind"] == "trl":
        trainer = _timed_grpo_trainer_class()(**kwargs)
    else:
        from a3po_trl import AsyncA3POTrainer

        trainer = AsyncA3POTrainer(**kwargs)
    return trainer, model_name


def step_timer_callback():
    from transformers import TrainerCallback

    from a3po_trl.timeline.overlap import thread_cpu_clock

    class StepTimer(TrainerCallback):
        """perf_counter at train begin and at the end of every optimizer step, with each thread's CPU seconds since
        train begin at each step end: the training (main) thread's, and the generation thread's where there is one
        (read through its CPU clock; None before it starts and where there is no per-thread clock). ``trainer`` is
        set once the trainer exists."""

        def __init__(self):
            self.begin = None
            self.cpu_begin = None
            self.step_ends = []
            self.trainer_cpu = []
            self.generator_cpu = []
            self.trainer = None
            self._clock = (None, None)  # (the generation thread, its clock)

        def on_train_begin(self, args, state, control, **kwargs):
            self.begin, self.cpu_begin = time.perf_counter(), time.thread_time()

        def on_step_end(self, args, state, control, **kwargs):
            self._sync()
            self.step_ends.append(time.perf_counter())
            self.trainer_cpu.append(time.thread_time() - self.cpu_begin)
            self.generator_cpu.append(self._generator_cpu())

        def _generator_cpu(self):
            producer = getattr(self.trainer, "_producer", None)
            thread = getattr(producer, "thread", None)
            if thread is None:
                return None
            if self._clock[0] is not thread:
                self._clock = (thread, thread_cpu_clock(thread))
            if self._clock[1] is not None:
                try:
                    return self._clock[1]()
                except OSError:
                    pass
            return producer.thread_cpu_at_exit  # it ended (its clock is gone): its total, kept as it ended

        @staticmethod
        def _sync():
            import torch

            if torch.cuda.is_available() and torch.cuda.is_initialized():
                torch.cuda.synchronize()

    return StepTimer()
