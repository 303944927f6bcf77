"""Reward functions in worker processes (a3po_trl/rollout/reward_workers.py): the same rewards and logged values as in
the thread, a function's error raised with its name and the worker's traceback, a dead worker named (not waited for),
functions that cannot be sent refused with the fix, and no process left once the pool is closed."""

import math
import sys
import time
from types import ModuleType, SimpleNamespace

import pytest
import torch
from tiny import answer_reward, async_length_reward, exiting_reward, failing_reward, length_reward, sleeping_reward

from a3po_trl.rollout.reward_workers import RewardWorkers, WorkerTraceback, _pickled_call, check_sendable
from a3po_trl.rollout.scoring import score_completions

# A module that exists only in this process: its function pickles (by reference) but no worker can import it.
ONLY_HERE = ModuleType("reward_module_only_in_this_process")
exec("def unimportable_reward(completions, **kwargs):\n    return [0.0] * len(completions)\n", ONLY_HERE.__dict__)
sys.modules[ONLY_HERE.__name__] = ONLY_HERE

FUNCS = [answer_reward, async_length_reward, length_reward, failing_reward, ONLY_HERE.unimportable_reward]
NAMES = [f.__name__ for f in FUNCS]
ROWS = [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(4)]
PROMPTS = [row["prompt"] for row in ROWS]
COMPLETIONS = [[{"role": "assistant", "content": text}] for text in ("it is 0", "no digit", "2", "3 or 4")]


@pytest.fixture(scope="module")
def workers():
    pool = RewardWorkers(FUNCS, NAMES, num_workers=2)
    yield pool
    pool.close()


def _score(workers, skip):
    extra, metrics = {}, {}
    kwargs = {
        "trainer_state": SimpleNamespace(global_step=7),
        "log_extra": lambda column, values: extra.setdefault(column, []).extend(values),
        "log_metric": lambda name, value: metrics.setdefault(name, []).append(value),
    }
    rewards = score_completions(
        FUNCS, NAMES, [None] * len(FUNCS), ROWS, PROMPTS, COMPLETIONS, [[1]] * 4, kwargs, skip=skip, workers=workers
    )
    return rewards, extra, metrics


def test_workers_score_and_log_as_the_thread(workers):
    in_thread = _score(None, skip={3, 4})
    in_workers = _score(workers, skip={3, 4})
    assert torch.equal(in_thread[0].isnan(), in_workers[0].isnan())
    assert torch.equal(in_thread[0].nan_to_num(), in_workers[0].nan_to_num())
    assert math.isnan(in_workers[0][1, 0])  # None: not scored
    assert in_workers[0][:, 0].nan_to_num().tolist() == [1.0, 0.0, 1.0, 1.0]
    assert in_thread[1:] == in_workers[1:]
    assert in_workers[1] == {"answer_seen": ["0", "1", "2", "3"]}
    assert in_workers[2] == {"answer_reward/step": [7.0], "async_length_reward/calls": [1.0]}


def test_a_functions_error_is_raised_with_its_name_and_the_workers_traceback(workers):
    with pytest.raises(ValueError, match="cannot score 4 completions") as info:
        _score(workers, skip={4})
    assert "'failing_reward' in a reward worker process" in "".join(info.value.__notes__)
    cause = info.value.__cause__
    assert isinstance(cause, WorkerTraceback) and 'raise ValueError(f"cannot score' in str(cause)
    assert torch.isfinite(_score(workers, skip={3, 4})[0][:, 2]).all()  # the pool scores on


def test_a_function_a_worker_cannot_import_is_named_with_the_fix(workers):
    with pytest.raises(ModuleNotFoundError, match="reward_module_only_in_this_process") as info:
        _score(workers, skip={3})
    assert "'unimportable_reward' could not be loaded in a reward worker process" in "".join(info.value.__notes__)
    assert "top level of an importable module" in "".join(info.value.__notes__)


def test_arguments_that_cannot_be_sent_are_named():
    with pytest.raises(TypeError, match="reward keyword argument 'judge_client'.*reward_num_workers=0"):
        _pickled_call(PROMPTS, COMPLETIONS, [[1]] * 4, {"judge_client": lambda text: text})


def test_a_worker_that_dies_is_named_and_the_pool_closes():
    funcs, names = [length_reward, exiting_reward], ["length_reward", "exiting_reward"]
    pool = RewardWorkers(funcs, names, num_workers=1)
    processes, manager = list(pool._executor._processes.values()), pool._executor._executor_manager_thread
    with pytest.raises(RuntimeError, match=r"reward worker process died .*'exiting_reward'"):
        score_completions(funcs, names, [None, None], ROWS, PROMPTS, COMPLETIONS, [[1]] * 4, workers=pool)
    pool.close(timeout=5.0)
    # Closed means every worker ended and reaped (its exit code known) and the pool's manager thread done: that thread
    # reaps the workers of a broken pool too, and a worker it reaped is only seen as ended once it recorded the code.
    assert processes and all(process.exitcode is not None for process in processes)
    assert not manager.is_alive()


def test_closing_ends_a_call_that_does_not_return(tmp_path):
    pool = RewardWorkers([sleeping_reward], ["sleeping_reward"], num_workers=1)
    processes, manager = list(pool._executor._processes.values()), pool._executor._executor_manager_thread
    started = tmp_path / "started"
    pending = pool.submit([0], PROMPTS, COMPLETIONS, [[1]] * 4, {"started_file": str(started)})
    deadline = time.monotonic() + 300
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert started.exists()  # the call is running
    start = time.monotonic()
    pool.close(timeout=1.0)
    assert time.monotonic() - start < 30
    assert all(process.exitcode is not None for process in processes) and not manager.is_alive()
    with pytest.raises(RuntimeError, match="'sleeping_reward'"):
        pending.results()


def _local_reward(completions, **kwargs):
    return [0.0] * len(completions)


def test_functions_that_cannot_be_sent_are_refused_with_the_fix():
    model = torch.nn.Linear(1, 1)

    def closure_over_a_model(completions, **kwargs):
        return [float(model.weight.sum())] * len(completions)

    for func in (lambda completions, **kwargs: [0.0], closure_over_a_model):
        name = func.__name__
        with pytest.raises(ValueError, match=f"'{name}' cannot be sent.*top level.*reward_num_workers=0"):
            check_sendable([length_reward, func], ["length_reward", name])
    assert len(check_sendable([_local_reward, torch.nn.Linear(1, 1)], ["a", "model"])) == 1  # models stay here


def test_a_notebooks_function_is_refused_with_the_fix(monkeypatch):
    notebook = ModuleType("__main__")  # an interactive session's main module has no __file__
    monkeypatch.setitem(sys.modules, "__main__", notebook)
    monkeypatch.setattr(_local_reward, "__module__", "__main__")
    with pytest.raises(ValueError, match="'_local_reward' is defined in an interactive session.*a .py file"):
        check_sendable([_local_reward], ["_local_reward"])
