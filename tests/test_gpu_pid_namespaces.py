"""A serving process in another pid namespace than the daemon's (a Kubernetes pod without hostPID
beside the DaemonSet's, which shares the host's IPC namespace). Measured on the H200 host (driver
580.159.04): with the daemon in the host's pid namespace (the DaemonSet's hostPID: true) a client in
a namespace of its own maps the HBM arena by its CUDA IPC handle and reads exactly the bytes another
client wrote; with the daemon in a namespace of its own too, its attach fails
(cudaErrorDeviceUninitialized), saying that the pid namespaces differ and what to do. Run on the GPU
machine, as root (unshare(1)); each outcome is printed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from gpu_helpers import GPU, daemon_on

pytestmark = [*GPU, pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                       reason="needs root and unshare(1) to run a client in a pid namespace of its own")]
OWN_PID_NAMESPACE = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child=SIGTERM"]

READER = """
import json, sys, numpy as np, cupy as cp
from dflash2.client import Client
from dflash2.errors import ArenaError
from dflash2.layout import Layout
cp.cuda.runtime.getDeviceCount()
try:
    c = Client.connect(config=sys.argv[1], name="reader", layouts=[Layout("u8", 1, 1, 64, "int8", 16)])
except ArenaError as e:
    print(json.dumps({"error": str(e)}))
    sys.exit(0)
found = c.lookup([21, 22])
got = c.acquire(found["vid"])
data = [cp.asnumpy(c.view_bytes(p)).tolist() for p in got]
c.release(found["vid"])
c.close()
print(json.dumps({"data": data}))
"""


@pytest.mark.parametrize("daemon_namespace", ["the host's", "its own"])
def test_a_client_in_a_pid_namespace_of_its_own_reads_exact_bytes_or_is_told_why(cuda_config, daemon_namespace):
    import cupy as cp

    from dflash2.client import Client
    from dflash2.layout import Layout

    path = cuda_config()
    with daemon_on(path, prefix=OWN_PID_NAMESPACE if daemon_namespace == "its own" else ()):
        with Client.connect(config=path, name="writer", layouts=[Layout("u8", 1, 1, 64, "int8", 16)]) as w:
            places = w.allocate(w.layout_ids[0], 2)
            written = []
            for i, p in enumerate(places):
                view = w.view_bytes(p)
                view[:] = cp.arange(view.size, dtype=cp.uint8) + i
                written.append(cp.asnumpy(view).tolist())
            cp.cuda.runtime.deviceSynchronize()
            w.commit(places["vid"], keys=[21, 22])
            out = subprocess.run([*OWN_PID_NAMESPACE, sys.executable, "-c", READER, path], capture_output=True,
                                 text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"a client in a pid namespace of its own, the daemon in {daemon_namespace}:",
          "read the bytes" if "data" in res else res["error"])
    if daemon_namespace == "the host's":
        assert res.get("data") == written, res  # (the DaemonSet's case: hostPID)
    elif "error" in res:  # (the driver of the H200 host: a namespace each does not map)
        assert "runs in another pid namespace" in res["error"] and "hostPID: true in the DaemonSet" in res["error"]
    else:
        assert res["data"] == written
