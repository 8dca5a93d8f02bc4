"""GPU UUIDs as text: how the daemon and its clients name the same GPU. Device numbers differ
between processes (CUDA_VISIBLE_DEVICES, a container's GPU assignment); a GPU's UUID does not.
No CUDA here: the daemon's protocol handling uses it on any machine."""

from __future__ import annotations


def uuid_text(raw) -> str:
    """A GPU's UUID as nvidia-smi and CUDA_VISIBLE_DEVICES write it: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    (from CuPy's 16 raw bytes, or from torch's text without the prefix)."""
    if isinstance(raw, (bytes, bytearray)):
        if len(raw) != 16:
            raise ValueError(f"a GPU UUID has 16 bytes, got {len(raw)}")
        h = bytes(raw).hex()
    else:
        h = str(raw).strip().lower()
        h = h[4:] if h.startswith("gpu-") else h
        h = h.replace("-", "")
        if len(h) != 32 or any(ch not in "0123456789abcdef" for ch in h):
            raise ValueError(f"not a GPU UUID: {raw!r}")
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def device_of(devices: dict[int, str], uuid: str) -> int:
    """The number, among `devices` (number -> UUID), of the GPU with this UUID; ValueError naming
    the GPUs there are when none has it (or the UUID is malformed)."""
    want = uuid_text(uuid)
    for device, have in devices.items():
        if uuid_text(have) == want:
            return device
    served = ", ".join(f"{u} (device {d})" for d, u in sorted(devices.items())) or "no GPU"
    raise ValueError(f"GPU {want} is not served here; this daemon serves {served}")
