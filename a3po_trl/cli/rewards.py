"""The rewards of ``a3po-trl grpo``, resolved as ``trl grpo`` resolves them: ``--reward_model_name_or_path`` first (the
trainer loads it), then each ``--reward_funcs`` entry, a name of TRL's registry or a dotted import path
(``my_pkg.rewards.my_reward``, importable from the working directory too). A name that resolves to nothing is refused
here, naming it and the fix, before any model loads."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable

from .arguments import CommandLineError

#: Registry rewards that need a package ``trl`` does not install: ``{name: (module, pip package)}``.
REGISTRY_REQUIREMENTS = {
    "accuracy_reward": ("math_verify", "math-verify"),
    "reasoning_accuracy_reward": ("math_verify", "math-verify"),
}


def trl_reward_registry() -> dict[str, Callable]:
    """The reward functions ``trl grpo`` knows by name, with the arguments it gives them: the registry of
    ``trl/scripts/grpo.py``, which the script builds inside its ``main`` (so it cannot be imported);
    ``tests/unit/test_cli_arguments.py`` checks that the names are the installed TRL's."""
    from trl.rewards import (
        accuracy_reward,
        get_soft_overlong_punishment,
        reasoning_accuracy_reward,
        think_format_reward,
    )

    return {
        "accuracy_reward": accuracy_reward,
        "reasoning_accuracy_reward": reasoning_accuracy_reward,
        "think_format_reward": think_format_reward,
        "get_soft_overlong_punishment": get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256),
    }


def resolve_rewards(reward_model_name_or_path: str | None, reward_funcs: list[str] | None) -> list:
    """The trainer's ``reward_funcs``: the reward model's id or path, then each function, in order."""
    rewards: list = [reward_model_name_or_path] if reward_model_name_or_path else []
    registry = trl_reward_registry()
    if isinstance(reward_funcs, str):  # `reward_funcs: name` in a YAML file, not a list
        reward_funcs = [reward_funcs]
    for name in reward_funcs or []:
        if name in registry:
            _check_requirement(name)
            rewards.append(registry[name])
        elif "." in name:
            rewards.append(import_reward(name))
        else:
            close = difflib.get_close_matches(name, list(registry), n=2, cutoff=0.6)
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            raise CommandLineError(
                f"--reward_funcs {name}: no reward of that name. Give one of TRL's rewards ({', '.join(registry)}) "
                f"or the import path of a function (my_module.my_reward, importable from the working directory or "
                f"installed).{hint}"
            )
    if not rewards:
        raise CommandLineError(
            "No reward: pass --reward_funcs (TRL's rewards by name, e.g. think_format_reward, or import paths such as "
            "my_module.my_reward) and/or --reward_model_name_or_path (a sequence-classification model), on the "
            "command line or in the --config file."
        )
    return rewards


def _check_requirement(name: str) -> None:
    if name not in REGISTRY_REQUIREMENTS:
        return
    module, package = REGISTRY_REQUIREMENTS[name]
    if importlib.util.find_spec(module) is None:
        raise CommandLineError(
            f"--reward_funcs {name} needs the `{package}` package, which is not installed: pip install {package}."
        )


def import_reward(path: str) -> Callable:
    """The function at the dotted import path ``path``, the working directory on ``sys.path`` (as ``trl grpo`` puts
    it), or an error naming ``--reward_funcs`` and what is wrong."""
    module_path, attribute = path.rsplit(".", 1)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as error:
        if error.name is not None and f"{module_path}.".startswith(f"{error.name}."):
            raise CommandLineError(
                f"--reward_funcs {path}: there is no module {error.name} (looked in the working directory "
                f"{os.getcwd()} and the installed packages). Check the spelling, run from the folder that holds "
                f"{error.name.replace('.', '/')}.py, or install the package that provides it."
            ) from error
        raise CommandLineError(f"--reward_funcs {path}: importing {module_path} failed: {error!r}.") from error
    except Exception as error:
        raise CommandLineError(f"--reward_funcs {path}: importing {module_path} failed: {error!r}.") from error
    if not hasattr(module, attribute):
        functions = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        close = difflib.get_close_matches(attribute, functions, n=2, cutoff=0.6)
        hint = f" Did you mean {' or '.join(f'{module_path}.{c}' for c in close)}?" if close else ""
        raise CommandLineError(
            f"--reward_funcs {path}: module {module_path} ({getattr(module, '__file__', 'built in')}) has no "
            f"{attribute}.{hint}"
        )
    reward = getattr(module, attribute)
    if not callable(reward):
        raise CommandLineError(
            f"--reward_funcs {path}: {attribute} is a {type(reward).__name__}, not a function; name a function "
            "(completions, **kwargs) -> list of floats."
        )
    return reward
