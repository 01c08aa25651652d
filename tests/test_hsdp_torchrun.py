"""Two real torchrun agents on this machine, one per "node" (the command README's cluster section
shows): scripts/hsdp_two_nodes.py trains HSDP through the lab's rank function, unchanged, equal to
single-process training and to torch's fully_shard on the same 2-D mesh, with the topology torchrun gave (2 nodes x 2 ranks)."""

import os
import signal
import socket
import subprocess
import sys

from conftest import ROOT


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(node_rank, port, tmp):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        f"--node-rank={node_rank}",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        os.path.join("scripts", "hsdp_two_nodes.py"),
    ]
    # TMPDIR: the agent's torchelastic_* folder lands in the test's own temp folder
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TMPDIR=str(tmp))
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_hsdp_on_two_torchrun_nodes_equals_one_process(tmp_path):
    port = _free_port()
    agents = [_agent(0, port, tmp_path), _agent(1, port, tmp_path)]
    outs = []
    try:
        for agent in agents:
            outs.append(agent.communicate(timeout=240))
    finally:
        for agent in agents:  # a hung agent dies with its workers (its own process group)
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
                agent.communicate()
    text = "\n".join(o + e for o, e in outs)
    assert all(a.returncode == 0 for a in agents), text[-4000:]
    assert "hsdp on 2 nodes x 2 ranks vs single-process and fully_shard: ok" in text, text[-4000:]
    assert "[(0, 0, 0, 2), (1, 0, 1, 2), (2, 1, 0, 2), (3, 1, 1, 2)]" in text, text[-4000:]
