"""Two "nodes" on one machine: two ``torchrun`` agents of 2 processes each, meeting through a c10d
rendezvous on 127.0.0.1, as a multi-node job meets. ZeRO-2/3 equal DDP at world size 4 and a
checkpoint saved there loads at the other stage."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

JOB = Path(__file__).with_name("_multinode_job.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_agents_with_a_c10d_rendezvous(tmp_path: Path) -> None:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
           "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "zero-multinode", str(JOB), str(tmp_path)]  # fmt: skip
    agents = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for _ in range(2)]  # fmt: skip
    outputs = []
    try:
        for a in agents:
            out, _ = a.communicate(timeout=300)
            outputs.append(out)
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    for a, out in zip(agents, outputs):
        assert a.returncode == 0, out[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert {r["world"] for r in results} == {4}
    assert sorted({r["node"] for r in results}) == ["0", "1"]  # two agents, two "nodes"
    for r in results:
        assert r["zero2_checked"] and r["zero3_checked"], r
        assert r["zero2_extra"] == {"stage": 2} and r["zero3_extra"] == {"stage": 3}
