"""Which GPU's block pool an attaching client uses (the Service's `attach`): a daemon serves every
GPU of its node, a pool each, and numbers them as it sees them, which a client's process may not."""

from __future__ import annotations

from dflash2.errors import ProtocolError
from dflash2.gpuid import device_of, uuid_text
from dflash2.protocol import arg
from dflash2.tiers import Tier


class Devices:
    """Needs `managers` (device -> BlockManager) of the Service."""

    def _gpu_uuids(self) -> dict[int, str]:
        """Each GPU pool's GPU UUID (none on a host daemon)."""
        out = {}
        for device, m in self.managers.items():
            hbm = m.arenas.get(Tier.HBM)
            uuid = getattr(hbm, "uuid", None)
            if uuid is not None:
                out[device] = uuid
        return out

    def _device_of(self, req) -> int:
        """The pool an attaching client uses: by `gpu_uuid` (the GPU it serves, which the daemon may
        number differently: CUDA_VISIBLE_DEVICES differs between containers and processes), else by
        `device` (the daemon's own number), else the first. A host daemon has one pool and no GPU:
        a `gpu_uuid` names nothing here and the client gets that pool (the reply says "host")."""
        first = next(iter(self.managers))
        uuid = arg(req, "gpu_uuid", str, default=None)
        if uuid is not None and req.args.get("device") is not None:
            raise ProtocolError("attach: give `gpu_uuid` or `device`, not both")
        if uuid is not None:
            uuids = self._gpu_uuids()
            try:
                want = uuid_text(uuid)  # a malformed one is refused on any daemon
                return device_of(uuids, want) if uuids else first
            except ValueError as e:
                raise ProtocolError(f"attach: argument 'gpu_uuid': {e}") from None
        device = arg(req, "device", int, default=None)  # null (the op table's default): the first
        device = first if device is None else device
        if device not in self.managers:
            raise ProtocolError(f"attach: device {device} is not served here; devices: {sorted(self.managers)}")
        return device
