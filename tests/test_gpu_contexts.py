"""No CUDA context on a GPU that a process does not serve (run on a two-GPU machine). A context costs
its GPU hundreds of MiB, taken from whoever uses that GPU (another tenant, another tensor-parallel
rank), and one cannot be made at all on a GPU in EXCLUSIVE_PROCESS mode that another process holds.
CuPy's `with Device(d)` sets back, on leaving, the device the runtime calls current, which in a
thread that never chose one is GPU 0 (and setting a device makes its context since CUDA 12); pinned
host memory was registered from whatever device was current. A daemon serving only GPU 1 made a
context on GPU 0, and so did a client serving GPU 1 when its heartbeat thread let a dead daemon's
HBM mapping go (a review, reading the code): cuda.on_device sets the device back only where the
thread had a context current."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from gpu_helpers import GPU, two_gpus

pytestmark = [*GPU, pytest.mark.skipif(not two_gpus(), reason="needs two GPUs (run on nvidia-h200-x2)")]

ACTIVE = """
    import ctypes
    from dflash2.cudadriver import libcuda
    def active(ordinal):  # whether the GPU's primary context is active in this process
        lib = libcuda()
        dev, flags, on = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
        assert lib.cuInit(0) == 0 and lib.cuDeviceGet(ctypes.byref(dev), ordinal) == 0
        assert lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(on)) == 0
        return on.value
"""

MANAGERS = ACTIVE + """
    import json, sys, uuid
    from dflash2.assemble import build_managers
    from dflash2.config import load_config
    managers = build_managers(load_config(sys.argv[1]), instance=f"dflash2-ctx-{uuid.uuid4().hex[:8]}")
    try:
        found = {"pools": sorted(managers), "gpu0": active(0), "gpu1": active(1)}
    finally:
        for m in managers.values():
            m.close()
    found["gpu0_after_close"] = active(0)
    print(json.dumps(found))
"""

CLIENT = ACTIVE + """
    import json, sys, time
    import cupy as cp
    cp.cuda.runtime.setDevice(1)  # a serving rank on GPU 1 (as torch.cuda.set_device(1) leaves it)
    from dflash2.client import Client, Layout
    c = Client.connect(config=sys.argv[1], name="ctx", layouts=[Layout("bf16", 4, 2, 64, "bf16", 16)], device=1)
    before = active(0)
    print("attached", flush=True)
    sys.stdin.readline()  # the test kills the daemon now
    deadline = time.monotonic() + 20
    while not c._ended and time.monotonic() < deadline:
        time.sleep(0.05)
    c._heartbeat_thread.join(20)  # (it lets the mapping go after `_ended` is set, then returns)
    print(json.dumps({"ended": c._ended, "before": before, "after": active(0)}), flush=True)
"""


def _on_gpu_1(cuda_config) -> str:
    path = cuda_config()
    cfg = json.loads(open(path).read())
    cfg["device"]["gpu_ids"] = [1]
    with open(path, "w") as f:
        f.write(json.dumps(cfg))
    return path


def test_a_daemon_serving_gpu_1_makes_no_context_on_gpu_0(tmp_path, cuda_config):
    path = _on_gpu_1(cuda_config)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(MANAGERS), path], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["pools"] == [1] and found["gpu1"] == 1, found
    assert found["gpu0"] == 0 and found["gpu0_after_close"] == 0, f"a daemon serving GPU 1 made a context on GPU 0: {found}"


def test_a_client_on_gpu_1_makes_no_context_on_gpu_0_when_its_daemon_dies(tmp_path, cuda_config):
    path = _on_gpu_1(cuda_config)
    daemon = subprocess.Popen(["dflash2d", "--config", path], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    client = None
    try:
        lines = []
        while not (lines and lines[-1].startswith("DFlash2: enabled")):
            lines.append(daemon.stdout.readline())
            assert lines[-1], "".join(lines)
        client = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CLIENT), path], cwd=tmp_path,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert client.stdout.readline().strip() == "attached", client.stderr.read()
        daemon.send_signal(signal.SIGKILL)
        daemon.wait(30)
        client.stdin.write("\n")
        client.stdin.flush()
        out, err = client.communicate(timeout=60)
        found = json.loads(out.strip().splitlines()[-1])
        assert found["ended"], err
        assert found["before"] == 0, f"attaching on GPU 1 made a context on GPU 0: {found}"
        assert found["after"] == 0, f"letting the dead daemon's mapping go made a context on GPU 0: {found}"
    finally:
        if client is not None and client.poll() is None:
            client.kill()
        if daemon.poll() is None:
            daemon.terminate()
            daemon.wait(30)
        for name in os.listdir("/dev/shm"):  # the killed daemon's segments
            if name.startswith(f"dflash2-{daemon.pid}"):
                os.unlink(f"/dev/shm/{name}")


THREAD = ACTIVE + """
    import json, threading
    import cupy as cp
    from dflash2.cuda import on_device
    cp.zeros(1)  # this process works on GPU 0 (its context made)
    seen = {}
    def worker():  # a thread that never chose a device, then works with the default one
        with on_device(1):
            cp.zeros(1)
        seen["device"] = cp.zeros(1).device.id
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    print(json.dumps(seen))
"""


def test_a_thread_is_set_back_where_that_makes_no_context(tmp_path):
    """A thread without a context of its own, in a process that works on GPU 0: after a dflash2 call
    on GPU 1 its default device is GPU 0 again (GPU 0's context is active already: setting it back
    makes none), as before on_device."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(THREAD)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"device": 0}
