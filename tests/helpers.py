"""Trainer-level helpers shared by the test files and the ``accelerate launch`` scripts in ``tests/scripts/``: the
settings the trainer tests share, building an ``AsyncA3POTrainer`` on the tiny model, reading its log history and its
generator's weights, simulating a crash after a checkpoint, and a stand-in trainer for the checkpoint code (no
model). No test file imports another ``test_*.py`` file; what
two of them use lives here or in ``tiny.py`` (as TRL keeps its shared test helpers in ``tests/testing_utils.py``).

A module of its own rather than more of ``tiny.py``: ``tiny.py`` holds *what* is trained (offline tokenizers, random
models, prompts, rewards) and imports nothing of ``a3po_trl`` (the benchmarks use its twin,
``a3po_trl.tasks.tiny_model``); this module holds *how* the tests build, run and inspect the trainer, and so depends
on the package.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import torch
from tiny import length_reward, make_model, make_prompts
from transformers import TrainerCallback

import a3po_trl.trainer
from a3po_trl import AsyncA3POConfig, AsyncA3POTrainer
from a3po_trl.checkpoints import save_checkpoint_atomically
from a3po_trl.patches import peft_base_model

#: The settings of the trainer tests: one optimizer step per batch of 4 (one prompt, 4 completions of 8 tokens), CPU.
COMMON = dict(
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=8,
    logging_steps=1,
    report_to="none",
    use_cpu=True,
    save_strategy="no",
    learning_rate=1e-2,
    seed=0,
)


def make_trainer(
    tokenizer,
    tmp_path,
    reward_funcs=(length_reward,),
    model=None,
    dataset=None,
    eval_dataset=None,
    trainer_class=AsyncA3POTrainer,
    **overrides,
):
    kwargs = {**COMMON, "max_steps": 4, **overrides}
    args = AsyncA3POConfig(output_dir=str(tmp_path / "out"), **kwargs)
    return trainer_class(
        model=model if model is not None else make_model(tokenizer),
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=dataset if dataset is not None else make_prompts(16),
        eval_dataset=eval_dataset,
        processing_class=tokenizer,
    )


class RecordingTrainer(AsyncA3POTrainer):
    """Records the prompts of every micro-batch it trains: ``trained[i]`` is the sorted list of the prompts (their
    token ids) of the ``i``-th micro-batch, one entry per row (``make_trainer(..., trainer_class=RecordingTrainer)``).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained = []

    def _prepare_inputs(self, generation_batch):
        inputs = super()._prepare_inputs(generation_batch)  # the micro-batch training_step trains next
        if self.model.training:
            rows = zip(inputs["prompt_ids"].tolist(), inputs["prompt_mask"].tolist())
            self.trained.append(sorted(tuple(i for i, m in zip(ids, mask) if m) for ids, mask in rows))
        return inputs


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def logged_after(trainer, key, step):
    """Values of `key` logged after optimizer step `step` (a resumed run's history starts with the checkpoint's)."""
    return [h[key] for h in trainer.state.log_history if key in h and h["step"] > step]


def model_weights(trainer):
    """A detached copy of every parameter of the trained model, by name."""
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def first_batch_with_logps(trainer):
    """The first micro-batch the trainer would train on (taken outside ``train()``), and the training forward's
    log-probs of its completions."""
    try:
        inputs = trainer._prepare_inputs(None)
    finally:
        trainer._stop_producer()
    input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, inputs["completion_ids"].size(1)
        )[0]
    return inputs, logps


def generator_matches(backend, module) -> bool:
    """Whether a ``generate`` backend's trainable weights equal ``module``'s (gathered under ZeRO-3 and FSDP2, on
    every process together), cast to the generator's dtype (bf16 under bf16 mixed precision)."""
    params = dict(module.named_parameters())
    whole = backend.weights.gather.full_tensors((name, params[name]) for name in backend.trainable_names)
    own = backend._own
    return all([torch.equal(own[name].cpu(), tensor.to(own[name].dtype).cpu()) for name, tensor in whole])


class StopAt(TrainerCallback):
    """Simulates a crash in the main thread right after `step` (after the checkpoint of that step is written)."""

    def __init__(self, step, error=KeyboardInterrupt):
        self.step, self.error = step, error

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise self.error()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a process group, a launcher or a server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def distributed_script_config(out_dir: str, **overrides):
    """The `AsyncA3POConfig` the `accelerate launch` test scripts share: 4 x 8-token completions, staleness 1, CPU."""
    settings = dict(
        output_dir=out_dir,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=4,
        max_staleness=1,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    return AsyncA3POConfig(**{**settings, **overrides})


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FSDP2_EXAMPLE = os.path.join(ROOT, "examples", "accelerate_configs", "fsdp2.yaml")


def fail_second_generation(trainer, message: str) -> None:
    """Make the backend ``trainer`` builds raise ``RuntimeError(message)`` on its second ``generate`` call (the
    `accelerate launch` test scripts' ``--fail-rank``: one process's generation failing mid-run)."""
    build = trainer._build_backend

    def failing_backend():
        backend, calls = build(), []
        generate = backend.generate

        def generate_then_fail(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError(message)
            return generate(*args, **kwargs)

        backend.generate = generate_then_fail
        return backend

    trainer._build_backend = failing_backend


def slow_second_generation(trainer, seconds: float) -> None:
    """Make the second ``generate`` call of the backend ``trainer`` builds take ``seconds`` longer (the `accelerate
    launch` test scripts' ``--slow-rank``: one process's generation keeping the others waiting)."""
    build = trainer._build_backend

    def slow_backend():
        backend, calls = build(), []
        generate = backend.generate

        def generate_slowly_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                time.sleep(seconds)
            return generate(*args, **kwargs)

        backend.generate = generate_slowly_once
        return backend

    trainer._build_backend = slow_backend


def launch_fsdp2(tmp_path, script, *args, fsdp_config=None, timeout=600, mixed_precision="no"):
    """``script OUT *args`` under ``accelerate launch`` with examples/accelerate_configs/fsdp2.yaml (two processes;
    ``mixed_precision``, off by default; a free port; ``fsdp_config`` entries overridden), the repository on
    the path. Returns the launcher's result and ``OUT`` (``tmp_path/out``, where the script writes its reports)."""
    import yaml

    config = yaml.safe_load(open(FSDP2_EXAMPLE))
    config.update(mixed_precision=mixed_precision, main_process_port=free_port())
    config["fsdp_config"].update(fsdp_config or {})
    (tmp_path / "fsdp2.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(tmp_path / "fsdp2.yaml")]
    result = run_process_tree([*command, script, str(out), *args], env=env, timeout=timeout, cwd=ROOT)
    return result, out


#: The environment variable that marks every process of one launch (:func:`run_process_tree`), whatever session it
#: moved to or parent it was left to.
PROCESS_TREE_MARKER = "A3PO_TEST_PROCESS_TREE"


def _marked(popen_kwargs: dict) -> tuple[dict, str]:
    """``popen_kwargs`` with an environment that marks the launch's processes, and the mark."""
    import uuid

    mark = uuid.uuid4().hex
    env = {**(popen_kwargs.get("env") or os.environ), PROCESS_TREE_MARKER: mark}
    return {**popen_kwargs, "env": env}, mark


def _kill_launch(process: subprocess.Popen, mark: str) -> None:
    """Kill the launcher's session and every process that inherited the launch's mark: torchrun starts its workers
    in sessions of their own, which a kill of the launcher's session misses (they went on running, holding the
    launcher's pipes, so reading its output never returned)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    needle = f"{PROCESS_TREE_MARKER}={mark}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as environ:
                marked = needle in environ.read().split(b"\0")
            if marked:
                os.kill(int(entry), signal.SIGKILL)
        except (OSError, ProcessLookupError):  # gone meanwhile, or not ours to read
            continue


def run_process_tree(command, *, timeout, **popen_kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout)`` for a command that starts
    processes of its own (``accelerate launch`` and its workers): it runs in a session of its own, and when it
    outlives ``timeout`` the whole session, and every process it started in a session of its own, is killed before
    ``TimeoutExpired`` is raised. ``subprocess.run`` kills the launcher only, which leaves its workers running (and
    holding their ports and cores) for the tests after."""
    popen_kwargs, mark = _marked(popen_kwargs)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **popen_kwargs
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_launch(process, mark)
        stdout, stderr = process.communicate()
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def run_process_trees(
    commands, *, timeout, grace_after_failure=15.0, **popen_kwargs
) -> list[subprocess.CompletedProcess]:
    """:func:`run_process_tree` for several commands at once (the launchers of the machines of one run), each in a
    session of its own, their output read as they run. Once one ends with a non-zero status the others have
    ``grace_after_failure`` seconds to end on their own (a peer's failure usually ends them with an error worth
    reading), after which their whole sessions are killed; past ``timeout`` every session still running is killed
    and ``TimeoutExpired`` raised, with every command's output so far. No session outlives the call, whatever
    ends it."""
    processes, outputs, readers, marks = [], [], [], []
    try:
        for command in commands:
            launch_kwargs, mark = _marked(popen_kwargs)
            marks.append(mark)
            process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                **launch_kwargs,
            )
            processes.append(process)
            output = {}
            outputs.append(output)
            reader = threading.Thread(
                target=lambda p=process, o=output: o.update(zip(("out", "err"), p.communicate()))
            )
            reader.start()
            readers.append(reader)
        deadline, kill_at = time.monotonic() + timeout, None
        while any(process.poll() is None for process in processes):
            now = time.monotonic()
            if now > deadline or (kill_at is not None and now > kill_at):
                break
            if kill_at is None and any(process.poll() not in (None, 0) for process in processes):
                kill_at = now + grace_after_failure
            time.sleep(0.1)
        timed_out = any(process.poll() is None for process in processes) and time.monotonic() > deadline
    finally:
        for process, mark in zip(processes, marks):  # also a launcher that ended: a worker left would hold the pipes
            _kill_launch(process, mark)
        for reader in readers:
            reader.join()
    if timed_out:
        joined = "\n".join(f"--- command {i}:\n{o.get('out', '')}" for i, o in enumerate(outputs))
        errors = "\n".join(f"--- command {i}:\n{o.get('err', '')}" for i, o in enumerate(outputs))
        raise subprocess.TimeoutExpired(list(commands), timeout, output=joined, stderr=errors)
    return [
        subprocess.CompletedProcess(command, process.returncode, output.get("out", ""), output.get("err", ""))
        for command, process, output in zip(commands, processes, outputs)
    ]


class _State(SimpleNamespace):
    def save_to_json(self, path):
        with open(path, "w") as file:
            json.dump({"global_step": self.global_step, "best_model_checkpoint": self.best_model_checkpoint}, file)


class StandInTrainer:
    """What the checkpoint code (a3po_trl/checkpoints/saves.py) reads of a trainer, without a model: ``save`` writes a
    small checkpoint (an optimizer state holding ``payload``, the trainer state). One process, or ``accelerator``'s."""

    def __init__(self, output_dir, save_total_limit=None, accelerator=None):
        self.accelerator = accelerator or SimpleNamespace(
            num_processes=1, process_index=0, is_main_process=True, wait_for_everyone=lambda: None
        )
        self.args = SimpleNamespace(
            output_dir=str(output_dir),
            should_save=self.accelerator.is_main_process,
            push_to_hub=False,
            save_total_limit=save_total_limit,
            save_on_each_node=False,
        )
        self.state = _State(global_step=0, best_model_checkpoint=None)
        self._checkpoint_staging_dir = None

    def _get_output_dir(self, trial):
        return self._checkpoint_staging_dir or self.args.output_dir

    def save(self, step, payload=1.0, interrupt_after_optimizer=False):
        """Save checkpoint ``step`` holding ``payload``; ``interrupt_after_optimizer``: killed mid-write. Each process
        writes its ``rng_state_{k}.pth`` (with several), the main one the rest."""
        self.state.global_step = step

        def write():
            folder = os.path.join(self._get_output_dir(None), f"checkpoint-{step}")
            os.makedirs(folder, exist_ok=True)
            if self.accelerator.num_processes > 1:
                torch.save(
                    {"rng": torch.ones(4)}, os.path.join(folder, f"rng_state_{self.accelerator.process_index}.pth")
                )
            if not self.args.should_save:
                return
            torch.save({"weights": torch.full((64,), payload)}, os.path.join(folder, "optimizer.pt"))
            if interrupt_after_optimizer:
                raise KeyboardInterrupt
            self.state.save_to_json(os.path.join(folder, "trainer_state.json"))

        return save_checkpoint_atomically(self, None, write)


CLI_REWARDS = '''
import os


def length_reward(completions, **kwargs):
    """Longer completions score higher (an import-path reward for the command-line tests)."""
    return [len(c[0]["content"] if isinstance(c, list) else c) / 10.0 for c in completions]


def rank_reward(completions, **kwargs):
    """Records which process scored a batch, in out/rank<RANK>.seen; rewards 0."""
    os.makedirs("out", exist_ok=True)
    with open(os.path.join("out", f"rank{os.environ.get('RANK', '0')}.seen"), "a") as seen:
        seen.write(f"{len(completions)}\\n")
    return [0.0] * len(completions)
'''


def cli_workspace(path, reward_model: bool = False) -> dict:
    """A working directory for ``a3po-trl grpo`` runs: the tiny model and tokenizer in ``model/`` (and a tiny
    sequence-classification reward model in ``reward_model/``), 16 conversational prompts in ``prompts.jsonl``,
    reward functions in ``cli_rewards.py`` (import paths ``cli_rewards.length_reward``, ``cli_rewards.rank_reward``).
    Returns the settings of a two-step CPU run, as the mapping of a YAML config (paths relative to ``path``)."""
    from tiny import make_reward_model, make_tokenizer

    tokenizer = make_tokenizer()
    make_model(tokenizer).save_pretrained(path / "model")
    tokenizer.save_pretrained(path / "model")
    if reward_model:
        make_reward_model(tokenizer).save_pretrained(path / "reward_model")
        tokenizer.save_pretrained(path / "reward_model")
    make_prompts(16).to_json(str(path / "prompts.jsonl"))
    (path / "cli_rewards.py").write_text(CLI_REWARDS)
    return {
        "model_name_or_path": "model",
        "dataset_name": "prompts.jsonl",
        "reward_funcs": ["think_format_reward", "cli_rewards.length_reward"],
        "output_dir": "out",
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": 2,
        "learning_rate": 0.01,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "use_cpu": True,
        "bf16": False,
        "seed": 0,
    }


SWITCH_AFTER = 3
"""In-flight tests: tokens a batch samples before its generator waits for, and then loads, the next version."""
LOCKSTEP_TIMEOUT = 600.0  # a guard against a hang only: a loaded 2-core machine can be very slow


class Lockstep:
    """Deterministic switch points of in-flight weight updates for ``trainer`` (``in_flight_weight_updates=True``),
    a function of the schedule, not of timing, and what each batch carried.

    The trainer takes batch ``j`` only once its generator has reached the third decode step (:data:`SWITCH_AFTER`) of
    batch ``j + lag``, where the generator, in a batch ``b >= lag``, waits until the trainer has published the version
    after the one it started with. So batch ``b`` samples its first 3 tokens with version ``b - lag`` and the rest
    with ``b - lag + 1`` (counted from the run's first version), in every run, on every process. The trainer also
    takes batch ``j`` only once the generator has finished batch ``j + lag - 1``, the last one that must not see the
    version training batch ``j`` publishes (for the last batches there is no batch ``j + lag`` to wait for).
    ``setattr_fn`` patches the trainer module's ``make_training_batch`` (``monkeypatch.setattr`` in a test)."""

    def __init__(self, trainer, setattr_fn, lag: int, num_batches: int):
        self.lag = lag
        self.started = [threading.Event() for _ in range(num_batches)]
        self.finished = [threading.Event() for _ in range(num_batches)]
        self.start_versions: dict[int, int] = {}
        self.token_versions: dict[int, torch.Tensor] = {}
        self.scored_versions: dict[int, int] = {}
        self.masks: dict[int, torch.Tensor] = {}
        self._batch, self._forwards, self.backend = -1, 0, None
        build = trainer._build_backend

        def build_with_hook():
            backend = self.backend = build()
            self.hook_generator(backend)
            generate = backend.generate

            def generate_batch(*args, **kwargs):  # one call per batch (single-turn; chunks run inside it)
                self._batch += 1
                self._forwards = 0
                self.start_versions[self._batch] = backend.version
                generated = generate(*args, **kwargs)
                self.finished[self._batch].set()
                return generated

            backend.generate = generate_batch
            return backend

        trainer._build_backend = build_with_hook
        make_training_batch = a3po_trl.trainer.make_training_batch

        def gated(trainer, scored, *args):
            self.token_versions[scored.index] = scored.tensors["token_versions"].clone()
            self.masks[scored.index] = scored.tensors["completion_mask"].bool().clone()
            self.scored_versions[scored.index] = scored.version
            following = scored.index + self.lag
            if following < len(self.started) and not self.started[following].wait(LOCKSTEP_TIMEOUT):
                raise RuntimeError(f"the generator did not start batch {following}")
            last_to_finish = following - 1  # before the version that training this batch publishes exists
            if last_to_finish < len(self.finished) and not self.finished[last_to_finish].wait(LOCKSTEP_TIMEOUT):
                raise RuntimeError(f"the generator did not finish batch {last_to_finish}")
            return make_training_batch(trainer, scored, *args)

        setattr_fn(a3po_trl.trainer, "make_training_batch", gated)

    def hook_generator(self, backend) -> None:
        """Call :meth:`_generator_forward` before each forward of the generator (a subclass hooks another backend)."""
        peft_base_model(backend.module).register_forward_pre_hook(self._generator_forward, with_kwargs=True)

    def _generator_forward(self, module=None, args=None, kwargs=None):
        self._forwards += 1
        if self._forwards == SWITCH_AFTER:  # the trainer may go on (and publish) only once this batch is here
            self.started[self._batch].set()
        if self._forwards == SWITCH_AFTER and self._batch >= self.lag:
            target = self.start_versions[self._batch] + 1
            deadline = time.monotonic() + LOCKSTEP_TIMEOUT
            while self.backend.published_version < target:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"version {target} was never published")
                time.sleep(0.005)

    def expected_versions(self, index: int, chunk_size: int | None = None) -> torch.Tensor:
        """The version of each token of batch ``index`` (as padded: -1 past each completion's end), generated in
        ``generate`` calls of ``chunk_size`` rows (``generation_batch_chunk_size``; ``None``: one call): the generator
        switches after its third forward of the batch, in whichever call that is (a call runs one forward per token
        of its longest completion), and the calls after it generate with the newer version only."""
        mask = self.masks[index]
        start = self.start_versions[index]
        lengths = mask.sum(dim=1)
        chunk = chunk_size or mask.size(0)
        earlier = torch.zeros_like(lengths)  # forwards of the batch before each row's call
        for first in range(chunk, mask.size(0), chunk):
            earlier[first:] += lengths[first - chunk : first].max()
        forward = earlier.unsqueeze(1) + torch.arange(mask.size(1)).expand_as(mask)
        switched = start + (forward >= SWITCH_AFTER).long() if index >= self.lag else torch.full_like(forward, start)
        return torch.where(mask, switched, torch.full_like(forward, -1))


class WrongInterpolation:
    """A-3PO's interpolation made wrong on purpose (weight -20 on the behavior log-probs instead of ``1/d``: far past
    both ends) while ``trainer``'s step is in ``wrong_steps`` and ``process`` (every process by default) is the
    trainer's, right otherwise: what ``prox_logp_method="guarded"``'s tests put in place of
    ``a3po_trl.proximal.anchor.approximate_proximal_logps``."""

    def __init__(self, trainer, wrong_steps, process: int | None = None):
        self.trainer, self.wrong_steps, self.process = trainer, set(wrong_steps), process

    def __call__(self, behavior_logps, current_logps, staleness):
        from a3po_trl.functional import approximate_proximal_logps

        here = self.process is None or self.trainer.accelerator.process_index == self.process
        if here and self.trainer.state.global_step in self.wrong_steps:
            return -20.0 * behavior_logps + 21.0 * current_logps.detach()
        return approximate_proximal_logps(behavior_logps, current_logps, staleness)


#: accelerate configurations of two CPU processes (gloo), by name, for the launch tests. `--cpu` / MULTI_CPU would
#: start ONE process: MULTI_GPU with use_cpu=True in the training arguments gives two gloo ranks.
ACCELERATE_CONFIGS = {
    "ddp": """
        distributed_type: MULTI_GPU
        num_processes: 2
        gpu_ids: all
        """,
    "zero2": """
        distributed_type: DEEPSPEED
        deepspeed_config:
          zero_stage: 2
          offload_optimizer_device: none
          offload_param_device: none
          zero3_init_flag: false
        num_processes: 2
        """,
    "zero3": """
        distributed_type: DEEPSPEED
        deepspeed_config:
          zero_stage: 3
          offload_optimizer_device: none
          offload_param_device: none
          zero3_init_flag: false
        num_processes: 2
        """,
}
_ACCELERATE_COMMON = """
compute_environment: LOCAL_MACHINE
mixed_precision: "no"
num_machines: 1
machine_rank: 0
main_process_port: {port}
"""


def accelerate_config(name: str, port: int) -> str:
    """The YAML of accelerate configuration ``name`` (:data:`ACCELERATE_CONFIGS`) on ``port``."""
    import textwrap

    return _ACCELERATE_COMMON.format(port=port) + textwrap.dedent(ACCELERATE_CONFIGS[name])
