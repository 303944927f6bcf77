"""The SLURM scripts in examples/slurm/ start what docs/SCALE_OUT.md says, on every node: run with ``bash`` under a
job's environment, with stand-ins for ``scontrol``, ``srun`` (which runs its command once per node of the step, with
that node's ``SLURM_NODEID`` and name, as SLURM does) and the commands the tasks start (``accelerate``, ``trl``: each
records its node, arguments and ``TMPDIR``). What the launches then do on two machines is
tests/integration/test_multi_node.py's."""

import json
import os
import stat
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HOSTS = ["gpu-a", "gpu-b", "gpu-c"]

SCONTROL = """
import os, sys
assert sys.argv[1:3] == ["show", "hostnames"] and sys.argv[3] == os.environ["SLURM_JOB_NODELIST"], sys.argv
print("\\n".join(os.environ["FAKE_HOSTS"].split(",")))
"""

SRUN = """
import os, subprocess, sys
args, options = sys.argv[1:], {}
while args[0].startswith("--"):  # the scripts write every srun option as --name=value
    name, _, value = args.pop(0)[2:].partition("=")
    options[name] = value
hosts = os.environ["FAKE_HOSTS"].split(",")
nodes = options["nodelist"].split(",") if "nodelist" in options else hosts[: int(options.get("nodes", len(hosts)))]
assert len(nodes) == int(options.get("nodes", len(nodes))), options
status = 0
for node in nodes:
    env = {**os.environ, "SLURM_NODEID": str(hosts.index(node)), "SLURMD_NODENAME": node}
    status = max(status, subprocess.run(args, env=env).returncode)
sys.exit(status)
"""

RECORD = """
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as log:
    record = {"node": os.environ["SLURMD_NODENAME"], "command": os.path.basename(sys.argv[0]), "args": sys.argv[1:]}
    log.write(json.dumps({**record, "TMPDIR": os.environ.get("TMPDIR")}) + "\\n")
"""


def _run_job(tmp_path, script, nodes, *args, **env):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, code in {"scontrol": SCONTROL, "srun": SRUN, "accelerate": RECORD, "trl": RECORD}.items():
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{code}")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "launches.jsonl"
    job = {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "FAKE_HOSTS": ",".join(HOSTS[:nodes]),
        "FAKE_LOG": str(log),
        "SLURM_JOB_NODELIST": f"gpu-[a-{'abc'[nodes - 1]}]",
        "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_ID": "4242",
        "SLURM_GPUS_ON_NODE": "4",
    }
    result = subprocess.run(
        ["bash", os.path.join(ROOT, "examples", "slurm", script), *args],
        cwd=tmp_path,
        env={**os.environ, **job, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return [json.loads(line) for line in log.read_text().splitlines()]


def _options(args):
    """``accelerate launch``'s options (before the script) as a mapping, the script, and its arguments."""
    script = next(i for i, arg in enumerate(args) if arg.endswith(".py"))
    options = dict(zip(args[1:script:2], args[2:script:2]))
    return options, args[script], args[script + 1 :]


def test_one_accelerate_launch_per_node_with_its_machine_rank_and_the_first_node_as_machine_0(tmp_path):
    launches = _run_job(tmp_path, "train_multi_node.sbatch", 2, "--output_dir", "/shared/run", "--max_steps", "5")
    assert [launch["node"] for launch in launches] == ["gpu-a", "gpu-b"]
    for machine, launch in enumerate(launches):
        assert launch["command"] == "accelerate" and launch["args"][0] == "launch"
        options, script, script_args = _options(launch["args"])
        assert options == {
            "--config_file": "examples/accelerate_configs/multi_node.yaml",
            "--num_machines": "2",
            "--machine_rank": str(machine),
            "--num_processes": "8",  # 2 nodes x SLURM_GPUS_ON_NODE
            "--main_process_ip": "gpu-a",
            "--main_process_port": "29500",
        }
        assert script == "examples/train_gsm8k.py"
        assert script_args == ["--output_dir", "/shared/run", "--max_steps", "5"]


def test_the_last_node_serves_vllm_and_the_others_train_against_it_through_a_shared_exchange_dir(tmp_path):
    launches = _run_job(
        tmp_path, "train_multi_node_vllm_server.sbatch", 3, "--max_steps", "5", MODEL="/shared/models/tiny"
    )
    server = [launch for launch in launches if launch["command"] == "trl"]
    training = [launch for launch in launches if launch["command"] == "accelerate"]
    assert [launch["node"] for launch in server] == ["gpu-c"]
    assert [launch["node"] for launch in training] == ["gpu-a", "gpu-b"]
    serve = server[0]["args"]
    assert serve[:3] == ["vllm-serve", "--model", "/shared/models/tiny"]
    assert serve[serve.index("--worker-extension-cls") + 1] == "a3po_trl.generation.vllm.worker.A3POWorkerExtension"
    assert serve[serve.index("--max-lora-rank") + 1] == "16" and serve[serve.index("--max-loras") + 1] == "8"
    exchange = str(tmp_path / "vllm-exchange" / "4242")
    assert os.path.isdir(exchange)
    for machine, launch in enumerate(training):
        options, script, script_args = _options(launch["args"])
        assert (options["--num_machines"], options["--machine_rank"], options["--num_processes"]) == (
            "2",
            str(machine),
            "8",
        )
        assert options["--main_process_ip"] == "gpu-a" and script == "examples/train_gsm8k.py"
        flags = dict(zip(script_args[::2], script_args[1::2]))
        assert flags["--use_vllm"] == "true" and flags["--vllm_mode"] == "server"
        assert (flags["--vllm_server_host"], flags["--vllm_server_port"]) == ("gpu-c", "8000")
        assert flags["--model_name_or_path"] == "/shared/models/tiny"
        assert (flags["--use_peft"], flags["--lora_r"]) == ("true", "16")
        assert script_args[-2:] == ["--max_steps", "5"]
        assert launch["TMPDIR"] == exchange  # where the trainer writes each version for the server to read


def test_full_weights_on_a_server_without_lora(tmp_path):
    launches = _run_job(tmp_path, "train_multi_node_vllm_server.sbatch", 3, MODEL="/shared/models/tiny", LORA_RANK="0")
    serve = next(launch["args"] for launch in launches if launch["command"] == "trl")
    assert "--enable-lora" not in serve and "--max-loras" not in serve
    for launch in launches:
        if launch["command"] == "accelerate":
            script_args = _options(launch["args"])[2]
            assert script_args[script_args.index("--use_peft") + 1] == "false"
