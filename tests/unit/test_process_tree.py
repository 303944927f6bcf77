"""The tests' launchers for commands that start processes of their own (``helpers.run_process_tree``, and
``run_process_trees`` for several at once): a launch that outlives its bound, or whose peer failed, must not leave its
workers behind for the tests after it."""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import run_process_tree, run_process_trees

# A launcher that starts a worker (which writes its pid, then sleeps), then waits for it, as `accelerate launch` does.
# The worker's output goes elsewhere, so that the launcher's pipes close when the launcher dies.
LAUNCHER = """
import subprocess, sys, time
worker_code = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
worker = subprocess.Popen(
    [sys.executable, "-c", worker_code, sys.argv[1]],
    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
)
print("launched", flush=True)
worker.wait()
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def test_a_launch_past_its_bound_takes_its_workers_with_it(tmp_path):
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_process_tree([sys.executable, "-c", LAUNCHER, str(pid_file)], timeout=5)
    assert "launched" in raised.value.output  # what the launcher printed before the bound comes with the error
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(worker):
        os.kill(worker, signal.SIGKILL)
        pytest.fail("the worker outlived its launcher's timeout")


# A launcher whose worker runs in a session of its own and writes to the launcher's output, as torchrun's workers do:
# a kill of the launcher's session misses it, and the launcher's pipes stay open while it runs.
LAUNCHER_OF_A_SESSION_LEADER = """
import subprocess, sys
worker_code = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
worker = subprocess.Popen([sys.executable, "-c", worker_code, sys.argv[1]], start_new_session=True)
print("launched", flush=True)
worker.wait()
"""


def test_a_launch_past_its_bound_takes_workers_in_sessions_of_their_own_with_it(tmp_path):
    """Before, the worker went on running after the launcher's session was killed, and reading the launcher's output
    waited for it (a stuck two-process test held the suite until its worker ended on its own)."""
    pid_file = tmp_path / "worker.pid"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_process_tree([sys.executable, "-c", LAUNCHER_OF_A_SESSION_LEADER, str(pid_file)], timeout=5)
    assert time.monotonic() - started < 60  # the worker sleeps 120 s
    assert _wait_until_dead(int(pid_file.read_text())), "the worker outlived its launcher's timeout"


def test_a_launch_within_its_bound_returns_its_exit_status_and_output():
    result = run_process_tree(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], timeout=60
    )
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")


def _wait_until_dead(pid: int, seconds: float = 10) -> bool:
    deadline = time.monotonic() + seconds
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if alive(pid):
        os.kill(pid, signal.SIGKILL)
        return False
    return True


def test_when_one_of_several_launches_fails_the_others_end_with_their_workers(tmp_path):
    """One machine's launcher failing leaves the other waiting for it (in a collective, until a timeout): after the
    grace period the other's whole tree is killed, and the call returns both statuses long before its bound."""
    pid_file = tmp_path / "worker.pid"
    started = time.monotonic()
    failed, waiting = run_process_trees(
        [
            [sys.executable, "-c", "import sys, time; time.sleep(1); print('failing'); sys.exit(1)"],
            [sys.executable, "-c", LAUNCHER, str(pid_file)],
        ],
        timeout=120,
        grace_after_failure=1,
    )
    assert time.monotonic() - started < 60
    assert (failed.returncode, failed.stdout) == (1, "failing\n")
    assert waiting.returncode == -signal.SIGKILL and "launched" in waiting.stdout
    assert _wait_until_dead(int(pid_file.read_text())), "the worker outlived its peer's failure"


def test_several_launches_past_their_bound_take_every_worker_with_them(tmp_path):
    pid_files = [tmp_path / f"worker{index}.pid" for index in range(2)]
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        run_process_trees([[sys.executable, "-c", LAUNCHER, str(path)] for path in pid_files], timeout=5)
    assert raised.value.output.count("launched") == 2
    for path in pid_files:
        assert _wait_until_dead(int(path.read_text())), "a worker outlived its launcher's timeout"
