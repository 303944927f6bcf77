"""`a3po-trl grpo` without training: the console script, the YAML files TRL's `trl grpo` takes, `--help`, TRL's reward
registry, and each refusal (an unknown flag or YAML key, a reward that resolves to nothing, a dataset without a prompt
column, ...) with the flag and the fix, before anything is launched or any model loads.

Every command runs in this process, from a working directory made by `helpers.cli_workspace`: `a3po-trl grpo` (the
console script, `a3po_trl.cli.main`) with accelerate's `launch_command` replaced by a recorder, and the training
program (`python -m a3po_trl.cli`, `a3po_trl.cli.run`) with its training step replaced by a recorder.
"""

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import re
from pathlib import Path

import accelerate.commands.launch
import pytest
import trl
import yaml
from helpers import cli_workspace
from trl import GRPOConfig

import a3po_trl.cli
import a3po_trl.cli.grpo
from a3po_trl import AsyncA3POConfig
from a3po_trl.cli.arguments import CommandLineError, a3po_field_names, parameter_docs
from a3po_trl.cli.rewards import trl_reward_registry

ROOT = Path(__file__).resolve().parents[2]

#: A config file as TRL's GRPO documentation writes them: script, model, PEFT, GRPOConfig fields and `env`.
TRL_YAML = {
    "model_name_or_path": "model",
    "dataset_name": "prompts.jsonl",
    "reward_funcs": ["think_format_reward", "cli_rewards.length_reward"],
    "output_dir": "out",
    "learning_rate": 1.0e-6,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 3,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 2,
    "num_generations": 4,
    "max_completion_length": 64,
    "temperature": 0.9,
    "beta": 0.04,
    "loss_type": "dapo",
    "epsilon_high": 0.28,
    "scale_rewards": "batch",
    "reward_weights": [1.0, 0.5],
    "logging_steps": 5,
    "save_steps": 50,
    "report_to": "none",
    "use_cpu": True,
    "bf16": False,
    "model_init_kwargs": {"low_cpu_mem_usage": True},
    "use_peft": True,
    "lora_r": 8,
    "lora_alpha": 16,
    "lora_target_modules": ["q_proj", "v_proj"],
    "dtype": "float32",
    "seed": 3,
    "env": {"A3PO_CLI_TEST_VARIABLE": "set by the config file"},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli")
    cli_workspace(path)
    (path / "questions.jsonl").write_text('{"question": "What is 1 + 1?", "answer": "2"}\n' * 8)
    (path / "notes.txt").write_text("not a dataset")
    return path


@pytest.fixture
def commands(workspace, monkeypatch):
    """``{"a3po-trl grpo": ..., "python -m a3po_trl.cli grpo": ...}``: each runs its argv (after ``grpo``) in the
    workspace and returns ``(exit status, launches, trainings)``, what it would have launched or trained."""
    monkeypatch.chdir(workspace)
    monkeypatch.delenv("A3PO_CLI_TEST_VARIABLE", raising=False)
    launches, trainings = [], []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", launches.append)
    monkeypatch.setattr(
        a3po_trl.cli.grpo, "train", lambda command_line, inputs: trainings.append((command_line, inputs))
    )

    def launcher(argv):
        return a3po_trl.cli.main(["grpo", *argv]), launches, trainings

    def program(argv):
        return a3po_trl.cli.run(["grpo", *argv]), launches, trainings

    return {"a3po-trl grpo": launcher, "python -m a3po_trl.cli grpo": program}


def write_yaml(path: Path, mapping: dict) -> str:
    path.write_text(yaml.safe_dump(mapping))
    return str(path)


def test_the_console_script_is_a3po_trl_grpo():
    scripts = (ROOT / "pyproject.toml").read_text().split("\n[project.scripts]\n")[1].split("\n[")[0]
    module, function = re.search(r'^a3po-trl = "([\w.]+):(\w+)"$', scripts, re.MULTILINE).groups()
    assert getattr(importlib.import_module(module), function) is a3po_trl.cli.main


def test_a_trl_yaml_gives_the_same_grpo_config_as_trl_grpo(workspace, monkeypatch):
    """TRL's own parser of `trl grpo` and ours read the same file into equal GRPOConfig fields, and equal script,
    model and dataset arguments. The one difference is deliberate: AsyncA3POConfig disables dropout by default."""
    monkeypatch.chdir(workspace)
    config = write_yaml(workspace / "trl.yaml", TRL_YAML)
    from trl.scripts.grpo import make_parser as trl_make_parser

    trl_script, trl_training, trl_model, trl_data = trl_make_parser().parse_args_and_config(["--config", config])
    parsed = a3po_trl.cli.parse_command_line(["--config", config], launching=True)
    assert type(parsed.training_args) is AsyncA3POConfig and type(trl_training) is GRPOConfig
    different = {
        f.name: (getattr(trl_training, f.name), getattr(parsed.training_args, f.name))
        for f in dataclasses.fields(GRPOConfig)
        if getattr(trl_training, f.name) != getattr(parsed.training_args, f.name)
    }
    assert different == {"disable_dropout": (False, True)}
    assert (parsed.script_args, parsed.model_args, parsed.dataset_args) == (trl_script, trl_model, trl_data)
    assert parsed.training_args.learning_rate == 1.0e-6 and parsed.model_args.lora_target_modules == [
        "q_proj",
        "v_proj",
    ]
    assert parsed.launch_args == [] and parsed.training_argv == ["--config", config]


def record_trl_grpo_launch(monkeypatch):
    """Run `trl grpo` (trl.cli.main) with its accelerate launch recorded instead of run."""
    import trl.cli.accelerate_launcher

    launched = []
    original = trl.cli.accelerate_launcher.launch_training_script
    monkeypatch.setattr(
        trl.cli.accelerate_launcher,
        "launch_training_script",
        lambda **kwargs: original(**kwargs, launch_command_fn=launched.append),
    )
    return launched


def test_a_yaml_trl_grpo_runs_runs_here_and_an_a3po_field_only_here(workspace, commands, monkeypatch, capsys):
    """The TRL YAML: `trl grpo` launches it, and so does `a3po-trl grpo`, unchanged. With an A-3PO field added,
    `trl grpo` refuses it (an unknown option of accelerate launch) and `a3po-trl grpo` reads it."""
    from trl.cli import main as trl_main

    trl_launched = record_trl_grpo_launch(monkeypatch)
    config = write_yaml(workspace / "trl.yaml", TRL_YAML)
    assert trl_main(["grpo", "--config", config]) == 0 and len(trl_launched) == 1
    status, launches, _ = commands["a3po-trl grpo"](["--config", config])
    assert status == 0 and len(launches) == 1
    assert launches[0].module and launches[0].training_script == "a3po_trl.cli"
    assert launches[0].training_script_args == ["grpo", "--config", config]

    a3po = write_yaml(workspace / "a3po.yaml", {**TRL_YAML, "max_staleness": 3, "prox_logp_method": "recompute"})
    with pytest.raises(SystemExit):
        trl_main(["grpo", "--config", a3po])
    assert "unrecognized arguments: --max_staleness" in capsys.readouterr().err
    assert len(trl_launched) == 1
    status, launches, _ = commands["a3po-trl grpo"](["--config", a3po])
    assert status == 0 and len(launches) == 2
    parsed = a3po_trl.cli.parse_command_line(["--config", a3po], launching=True)
    assert (parsed.training_args.max_staleness, parsed.training_args.prox_logp_method) == (3, "recompute")


def test_launch_options_go_to_accelerate_launch(workspace, commands):
    """As with `trl grpo`: launch options on the command line and as YAML keys (a switch as the bare flag; the command
    line wins), TRL's --accelerate_config resolved to its file; the launched program gets the rest."""
    launch_settings = {"multi_gpu": True, "main_process_port": 29123, "num_processes": 4}
    config = write_yaml(workspace / "launch.yaml", {**TRL_YAML, **launch_settings})
    status, launches, _ = commands["a3po-trl grpo"](
        ["--config", config, "--num_processes", "2", "--max_staleness", "2", "--accelerate_config", "multi_gpu"]
    )
    assert status == 0
    (launched,) = launches
    assert (launched.num_processes, launched.multi_gpu, launched.main_process_port) == (2, True, 29123)
    assert launched.config_file.endswith("accelerate_configs/multi_gpu.yaml")
    assert launched.training_script_args == ["grpo", "--config", config, "--max_staleness", "2"]


def test_the_program_trains_with_what_the_command_line_says(workspace, commands):
    config = write_yaml(workspace / "trl.yaml", TRL_YAML)
    status, launches, trainings = commands["python -m a3po_trl.cli grpo"](
        ["--config", config, "--max_staleness", "4", "--reward_funcs", "cli_rewards.length_reward"]
    )
    assert status == 0 and launches == []
    ((command_line, inputs),) = trainings
    assert command_line.training_args.max_staleness == 4 and command_line.model_args.use_peft
    assert [f.__name__ for f in inputs.reward_funcs] == ["length_reward"]
    assert len(inputs.train_dataset) == 16 and inputs.eval_dataset is None


def test_dynamic_sampling_is_a_flag_and_a_yaml_key(workspace):
    settings = {"dynamic_sampling": True, "dynamic_sampling_max_gen_batches": 4}
    config = write_yaml(workspace / "dynamic.yaml", {**TRL_YAML, **settings})
    argv = ["--config", config, "--dynamic_sampling_filter", "cli_rewards.length_reward"]
    args = a3po_trl.cli.parse_command_line(argv, launching=True).training_args
    assert args.dynamic_sampling and args.dynamic_sampling_max_gen_batches == 4
    assert args.dynamic_sampling_filter == "cli_rewards.length_reward"  # imported when the trainer starts
    plain = write_yaml(workspace / "trl.yaml", TRL_YAML)
    args = a3po_trl.cli.parse_command_line(["--config", plain, "--dynamic_sampling"], launching=True).training_args
    assert args.dynamic_sampling and args.dynamic_sampling_max_gen_batches == 10
    with pytest.raises(CommandLineError, match="dynamic_sampling_max_gen_batches=0 must be an integer >= 1"):
        a3po_trl.cli.parse_command_line(["--config", plain, "--dynamic_sampling_max_gen_batches", "0"], launching=True)


def test_help_lists_every_a3po_option_with_its_docstring(capsys):
    """Under a group of their own, each A-3PO option with its whole docstring paragraph (compared without white space:
    argparse rewraps it, and may break a word at a hyphen)."""
    with pytest.raises(SystemExit) as exit_:
        a3po_trl.cli.run(["grpo", "--help"])
    assert exit_.value.code == 0
    text = re.sub(r"\s", "", capsys.readouterr().out)
    a3po_section = text[text.index("A-3POoptions(AsyncA3POConfig)") :]
    docs = parameter_docs(AsyncA3POConfig)
    names = a3po_field_names()
    assert {"max_staleness", "prox_logp_method", "reproducible_generation", "behavior_weight_cap"} <= set(names)
    for name in names:
        assert f"--{name}" in a3po_section, name
        assert len(docs[name]) > 40 and re.sub(r"\s", "", docs[name]) in a3po_section, name


def test_every_documented_a3po_field_has_help_and_docstring():
    docs = parameter_docs(AsyncA3POConfig)
    for field in dataclasses.fields(AsyncA3POConfig):
        if field.name in a3po_field_names():
            assert field.metadata.get("help") and docs.get(field.name), field.name


def test_the_reward_names_are_those_of_the_installed_trl_grpo_script():
    """trl/scripts/grpo.py builds its registry inside `main`: read its names from the installed source."""
    source = Path(inspect.getfile(__import__("trl.scripts.grpo", fromlist=["main"]))).read_text()
    registries = [
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Assign)
        and any(getattr(t, "id", None) == "reward_funcs_registry" for t in node.targets)
    ]
    assert len(registries) == 1
    assert [key.value for key in registries[0].keys] == list(trl_reward_registry())
    assert trl_reward_registry()["think_format_reward"] is trl.rewards.think_format_reward


ENTRIES = ["a3po-trl grpo", "python -m a3po_trl.cli grpo"]

#: (argv after `--config base.yaml`, extra YAML settings, what the error must say)
REFUSALS = {
    "unknown flag": (["--max_stalness", "2"], {}, ["Unknown option --max_stalness", "Did you mean --max_staleness"]),
    "stray value": (["--max_staleness", "2", "3"], {}, ["Unexpected argument '3'"]),
    "unknown yaml key": ([], {"max_stalenes": 2}, ["base.yaml sets `max_stalenes`", "Did you mean max_staleness"]),
    "unknown reward name": (
        ["--reward_funcs", "think_format_rewards"],
        {},
        ["--reward_funcs think_format_rewards: no reward of that name", "Did you mean think_format_reward"],
    ),
    "reward module missing": (
        ["--reward_funcs", "no_such_module.reward"],
        {},
        ["--reward_funcs no_such_module.reward: there is no module no_such_module", "working directory"],
    ),
    "reward function missing": (
        ["--reward_funcs", "cli_rewards.lenght_reward"],
        {},
        [
            "--reward_funcs cli_rewards.lenght_reward: module cli_rewards",
            "has no lenght_reward",
            "Did you mean cli_rewards.length_reward",
        ],
    ),  # fmt: skip
    "no reward": ([], {"reward_funcs": None}, ["No reward: pass --reward_funcs", "--reward_model_name_or_path"]),
    "no prompt column": (
        ["--dataset_name", "questions.jsonl"],
        {},
        [
            "--dataset_name questions.jsonl: the 'train' split has no 'prompt' column",
            "['question', 'answer']",
            "rename the column",
        ],
    ),  # fmt: skip
    "missing data file": (["--dataset_name", "missing.jsonl"], {}, ["--dataset_name missing.jsonl: no such file"]),
    "unsupported data file": (["--dataset_name", "notes.txt"], {}, ["--dataset_name notes.txt: a .txt file"]),
    "missing train split": (
        ["--dataset_train_split", "training"],
        {},
        ["has no split 'training' (its splits: ['train']); name one with --dataset_train_split"],
    ),
    "missing eval split": (
        ["--eval_strategy", "steps", "--eval_steps", "1"],
        {},
        ["has no split 'test' to evaluate on", "--dataset_test_split", "--eval_strategy no"],
    ),
    "no dataset": ([], {"dataset_name": None}, ["No dataset: pass --dataset_name"]),
    "no model": ([], {"model_name_or_path": None}, ["No model: pass --model_name_or_path"]),
    "missing model folder": (
        ["--model_name_or_path", "./no_such_model"],
        {},
        ["--model_name_or_path ./no_such_model: no such model directory or Hub id: no such folder", "save_pretrained"],
    ),
    "missing absolute model path": (
        ["--model_name_or_path", "/no/such/model"],
        {},
        ["--model_name_or_path /no/such/model: no such model directory or Hub id: no such folder"],
    ),
    "missing nested model path": (
        ["--model_name_or_path", "out/checkpoint-9/model"],
        {},
        ["--model_name_or_path out/checkpoint-9/model: no such model directory or Hub id: no such folder"],
    ),
    "model path to a file": (
        ["--model_name_or_path", "notes.txt"],
        {},
        ["--model_name_or_path notes.txt: no such model directory or Hub id: a file, not a folder"],
    ),
    "invalid hub id": (
        ["--model_name_or_path", "Qwen/Qwen 2.5"],
        {},
        ["--model_name_or_path Qwen/Qwen 2.5: no such model directory or Hub id", "not a valid Hub id"],
    ),
    "a3po value": (["--max_staleness", "-1"], {}, ["max_staleness=-1 must be an integer >= 0"]),
}


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("case", list(REFUSALS))
def test_each_refusal_names_the_flag_and_the_fix_before_anything_runs(case, entry, workspace, commands, capsys):
    argv, settings, expected = REFUSALS[case]
    config = {**TRL_YAML, **settings}
    config = write_yaml(workspace / "base.yaml", {k: v for k, v in config.items() if v is not None})
    status, launches, trainings = commands[entry](["--config", config, *argv])
    error = capsys.readouterr().err
    assert status == 2, error
    assert launches == [] and trainings == []
    assert "a3po-trl grpo: error: " in error
    for text in expected:
        assert text in " ".join(error.split()), (text, error)


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "model", "./model", "absolute"])
def test_a_hub_id_or_a_local_folder_passes_without_contacting_the_hub(model, workspace, commands, monkeypatch):
    """A local folder launches, and so does a name of the Hub's form, left to the Hub (or its cache) when the model
    loads: nothing is looked up before the launch."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = str(workspace / "model") if model == "absolute" else model
    config = write_yaml(workspace / "trl.yaml", TRL_YAML)
    status, launches, _ = commands["a3po-trl grpo"](["--config", config, "--model_name_or_path", model])
    assert status == 0 and len(launches) == 1


def test_a_launch_option_after_the_program_says_where_it_goes(workspace, commands, capsys):
    config = write_yaml(workspace / "trl.yaml", TRL_YAML)
    status, _, trainings = commands["python -m a3po_trl.cli grpo"](["--config", config, "--num_processes", "2"])
    assert status == 2 and trainings == []
    assert "--num_processes is an option of `accelerate launch`" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("math_verify") is not None, reason="math_verify is installed")
@pytest.mark.parametrize("entry", ENTRIES)
def test_a_registry_reward_without_its_package_is_refused(entry, workspace, commands, capsys):
    config = write_yaml(workspace / "trl.yaml", TRL_YAML)
    status, launches, trainings = commands[entry](["--config", config, "--reward_funcs", "accuracy_reward"])
    assert status == 2 and launches == [] and trainings == []
    assert "--reward_funcs accuracy_reward needs the `math-verify` package" in capsys.readouterr().err


def test_a_reward_name_as_a_yaml_string_is_one_reward(workspace, commands):
    config = write_yaml(workspace / "string.yaml", {**TRL_YAML, "reward_funcs": "cli_rewards.length_reward"})
    status, _, trainings = commands["python -m a3po_trl.cli grpo"](["--config", config])
    assert status == 0 and [f.__name__ for f in trainings[0][1].reward_funcs] == ["length_reward"]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_config_file_that_is_not_yaml_is_refused(entry, workspace, commands, capsys):
    (workspace / "broken.yaml").write_text("model_name_or_path: [model\n")
    status, launches, trainings = commands[entry](["--config", "broken.yaml"])
    assert status == 2 and launches == [] and trainings == []
    assert "--config broken.yaml: not a valid YAML file" in capsys.readouterr().err


def test_dataset_name_takes_local_files_and_folders(workspace, monkeypatch):
    from datasets import Dataset, DatasetDict

    from a3po_trl.cli.data import load_named_dataset

    monkeypatch.chdir(workspace)
    rows = {"prompt": ["a", "b", "c"], "answer": ["1", "2", "3"]}
    Dataset.from_dict(rows).to_parquet("rows.parquet")
    Dataset.from_dict(rows).to_csv("rows.csv", index=False)
    Dataset.from_dict(rows).save_to_disk("saved_dataset")
    DatasetDict(train=Dataset.from_dict(rows), test=Dataset.from_dict(rows)).save_to_disk("saved_splits")
    (workspace / "folder").mkdir(exist_ok=True)
    Dataset.from_dict(rows).to_json("folder/part.jsonl")
    for name in ["prompts.jsonl", "rows.parquet", "rows.csv", "saved_dataset", "saved_splits", "folder"]:
        dataset = load_named_dataset(name)
        assert "train" in dataset and "prompt" in dataset["train"].column_names, name
    assert set(load_named_dataset("saved_splits")) == {"train", "test"}
    streamed = load_named_dataset("saved_dataset", streaming=True)["train"]
    assert next(iter(streamed))["prompt"] == "a"
