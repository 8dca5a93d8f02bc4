"""GPUs named by UUID between the daemon and its clients (their device numbers differ with
CUDA_VISIBLE_DEVICES): the text form, the daemon's choice of pool, a host-only client, and a client
without CuPy. The CUDA side (real UUIDs, a client that cannot see the daemon's GPU) is in
tests/test_gpu_nodes.py."""

from __future__ import annotations

import pytest
from conftest import SMALL

from dflash2.gpuid import device_of, uuid_text
from dflash2.protocol import Op

from dflash2.daemon.service import Service

from test_service_bad_input import call

RAW = bytes.fromhex("365351b90e0163a6d71c6b58a3727dcc")
TEXT = "GPU-365351b9-0e01-63a6-d71c-6b58a3727dcc"


def test_every_form_of_a_uuid_reads_the_same():
    """CuPy's 16 bytes, torch's text without the prefix, nvidia-smi's, in any case."""
    for form in (RAW, "365351b9-0e01-63a6-d71c-6b58a3727dcc", TEXT, TEXT.upper(), " " + TEXT + "\n"):
        assert uuid_text(form) == TEXT


@pytest.mark.parametrize("bad", [b"short", "GPU-xyz", "", "GPU-365351b9-0e01-63a6-d71c-6b58a3727dc"])
def test_malformed_uuids_are_refused(bad):
    with pytest.raises(ValueError):
        uuid_text(bad)


def test_the_pool_is_the_gpu_with_that_uuid_whatever_its_number():
    other = "GPU-00000000-0000-0000-0000-000000000001"
    assert device_of({0: other, 1: TEXT}, TEXT.upper()) == 1
    with pytest.raises(ValueError, match=f"not served here; this daemon serves {other} \\(device 0\\)"):
        device_of({0: other}, TEXT)


@pytest.fixture
def service(make_manager, clock):
    return Service(make_manager(hbm_blocks=16), lease_timeout_s=10.0, heartbeat_interval_s=2.0, clock=clock)


def _attach(svc, **extra):
    return call(svc, Op.ATTACH, args={"name": "c", "pid": 0, "layouts": [SMALL.to_dict()], **extra})


def test_a_host_daemon_gives_a_gpu_client_its_one_pool(service):
    reply = _attach(service, gpu_uuid=TEXT)
    assert reply.ok and reply.result["device"] == "host" and reply.result["gpu_uuid"] is None
    assert service.stats()["daemon"]["gpus"] == {}


@pytest.mark.parametrize("extra, problem", [
    ({"gpu_uuid": "GPU-nope"}, "not a GPU UUID"),
    ({"gpu_uuid": 7}, "must be str"),
    ({"gpu_uuid": TEXT, "device": 0}, "not both"),
])
def test_bad_gpu_names_at_attach_are_refused_and_attach_nobody(service, extra, problem):
    reply = _attach(service, **extra)
    assert not reply.ok and problem in reply.error_message
    assert not service.sessions


def test_a_client_without_cuda_sends_its_device_number():
    """No CUDA in the client process (no CuPy, or no GPU visible): the number goes as the daemon's."""
    from dflash2.client import client as client_mod
    from dflash2.cuda import cuda_available

    if cuda_available():
        pytest.skip("this process sees a GPU (tests/test_gpu_nodes.py covers that side)")
    assert client_mod._uuid_of_local_device(1) is None


def test_status_names_each_pools_gpu():
    from dflash2.status import render

    st = {"daemon": {"pid": 1, "device": "cuda", "gpus": {"0": TEXT, "1": "GPU-00000000-0000-0000-0000-000000000001"}},
          "tiers": {}, "reads": {}}
    lines = render(st).splitlines()
    assert lines[1] == f"GPUs: 0 {TEXT}, 1 GPU-00000000-0000-0000-0000-000000000001"
    assert not any(line.startswith("GPUs") for line in render({"daemon": {"gpus": {}}}).splitlines())


@pytest.fixture
def no_cupy(monkeypatch):
    """This process as a torch-only serving process on a GPU node: CuPy cannot be imported (the driver
    shows a GPU)."""
    import sys

    from dflash2 import plan

    monkeypatch.setitem(sys.modules, "cupy", None)
    monkeypatch.setattr(plan, "probe_gpus", lambda **_: [plan.Gpu(0, "H100", 80 << 30)])


def test_a_client_without_cupy_on_a_machine_without_a_gpu_is_not_told_to_install_it(no_cupy, monkeypatch, caplog):
    """README's walk on a CPU machine: `Client.connect(..., device=0)` to a host-only daemon logged that
    the CUDA path needs CuPy and that the number named another GPU's pool (there is no GPU)."""
    import logging

    from dflash2 import plan
    from dflash2.client.localgpu import uuid_of_local_device

    monkeypatch.setattr(plan, "probe_gpus", lambda **_: [])
    with caplog.at_level(logging.WARNING, logger="dflash2.client"):
        assert uuid_of_local_device(0) is None
    assert not [r for r in caplog.records if "CuPy" in r.getMessage()]
    monkeypatch.setattr(plan, "probe_gpus", lambda **_: [plan.Gpu(0, "H100", 80 << 30)])  # (a GPU node: said)
    with caplog.at_level(logging.WARNING, logger="dflash2.client"):
        assert uuid_of_local_device(0) is None
    assert [r for r in caplog.records if "cannot read the UUID of its GPU 0" in r.getMessage()]


def _cuda_arena(**extra) -> dict:
    return {"tier": "hbm", "kind": "cuda", "device": 0, "ipc_handle": "00" * 64, "capacity_bytes": 1 << 20,
            "alignment": 256, **extra}


@pytest.mark.parametrize("extra", [{"uuid": TEXT}, {}], ids=["uuid", "older-daemon"])
def test_a_client_without_cupy_is_told_cupy_is_missing_not_that_the_gpu_is_invisible(no_cupy, extra):
    """It was told the daemon's GPU was not visible to it (set CUDA_VISIBLE_DEVICES), and, in another pid
    namespace, to run the daemon in the host's: for an IPC handle it never opened (a review)."""
    from dflash2.client.transport import pid_namespace
    from dflash2.client.views import ArenaMap
    from dflash2.errors import ArenaError

    with pytest.raises(ArenaError) as e:
        ArenaMap([_cuda_arena(**extra)], daemon_pid_namespace=(pid_namespace() or 0) + 1)
    assert "the CUDA path needs CuPy (pip install 'dflash2[gpu]')" in str(e.value)
    assert "does not see" not in str(e.value) and "pid namespace" not in str(e.value)


def test_an_ipc_handle_that_will_not_open_still_names_the_pid_namespaces(monkeypatch):
    """The advice stays where ipcOpenMemHandle itself failed."""
    import os

    import dflash2.cuda as cuda_mod
    from dflash2.client.views import ArenaMap
    from dflash2.cuda.arena import CudaArena
    from dflash2.errors import ArenaError

    if not os.path.exists("/proc/self/ns/pid"):
        pytest.skip("no pid namespace to compare here")

    def refuse(*args, **kwargs):
        raise ArenaError("cannot map the HBM arena of GPU 0 by IPC handle: cudaErrorInvalidValue")

    monkeypatch.setattr(cuda_mod, "cupy", lambda: object())
    monkeypatch.setattr(CudaArena, "attach", refuse)
    own = os.stat("/proc/self/ns/pid").st_ino
    with pytest.raises(ArenaError) as e:
        ArenaMap([_cuda_arena()], daemon_pid_namespace=own + 1)
    assert str(e.value).startswith("cannot map the HBM arena of GPU 0 by IPC handle")
    assert f"this process runs in another pid namespace (pid:[{own}]) than the daemon (pid:[{own + 1}])" in str(e.value)


def test_a_client_without_cupy_says_in_the_log_that_its_device_number_goes_as_the_daemons(no_cupy, caplog):
    """No silent fallback: the number alone names another GPU's pool where the daemon numbers its GPUs
    otherwise (a review)."""
    from dflash2.client import client as client_mod

    with caplog.at_level("WARNING", logger="dflash2.client"):
        assert client_mod._uuid_of_local_device(1) is None
    assert "needs CuPy (pip install 'dflash2[gpu]')" in caplog.text
    assert "the daemon takes 1 for its own device number" in caplog.text


def test_a_client_without_cupy_does_not_import_torch_to_probe_for_a_gpu():
    """Its attach on a machine without CuPy probed for GPUs as the daemon does, torch's fallback too:
    torch imported (1.5-2 s, the stop signals blocked) into a process that never used it (a review)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['cupy'] = None\n"
            "import dflash2.cudadriver as d\n"
            "def none(): raise OSError('no driver here')\n"
            "d.libcuda = none\n"
            "import dflash2.plan as p; p.libcuda = none\n"
            "from dflash2.client.localgpu import uuid_of_local_device\n"
            "assert uuid_of_local_device(0) is None\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "torch was imported to probe for a GPU"
