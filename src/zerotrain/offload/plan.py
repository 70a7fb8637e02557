"""What to offload where, read once from ``zero_optimization`` and checked against the stage."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

SWAP_SLOTS = 3   # NVMe: one record being read, one stepped, one written back


@dataclass(frozen=True)
class OffloadPlan:
    """optimizer: where fp32 masters and optimizer state live ("none", "cpu", "nvme").
    param: where stage-3 parameter shards live between uses ("none", "cpu", "nvme").
    delayed_update: step on the host while the next micro-batches run (``dpu``).
    """

    optimizer: str = "none"
    param: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = False
    param_nvme_path: Optional[str] = None
    param_pin_memory: bool = False
    buffer_count: int = SWAP_SLOTS
    delayed_update: bool = False

    @property
    def optimizer_offloaded(self) -> bool:
        return self.optimizer != "none"

    @property
    def param_offloaded(self) -> bool:
        return self.param != "none"

    @classmethod
    def from_config(cls, zero) -> "OffloadPlan":
        """Validate ``zero_optimization.offload_*`` for ``zero.stage``; errors name the key."""
        opt, par = zero.offload_optimizer, zero.offload_param
        opt_device = opt.device if opt is not None else "none"
        par_device = par.device if par is not None else "none"
        key = "zero_optimization.offload_optimizer"
        if opt_device != "none" and zero.stage == 0:
            raise ConfigError(f"{key}.device", "offloading the optimizer needs ZeRO stage 1, "
                              "2 or 3 (set zero_optimization.stage)", value=opt_device)
        if par_device != "none":
            pkey = "zero_optimization.offload_param"
            if zero.stage != 3:
                raise ConfigError(f"{pkey}.device", "parameter offload needs ZeRO stage 3: "
                                  "stages 0-2 keep whole parameters on the device",
                                  value=par_device)
        for name, section in (("offload_optimizer", opt), ("offload_param", par)):
            if section is not None and section.device != "none" and section.ratio != 1.0:
                raise ConfigError(f"zero_optimization.{name}.ratio", "partial offload is not "
                                  "supported; use 1.0 (all) or device \"none\"",
                                  value=section.ratio)
        dpu = bool(opt is not None and opt.dpu)
        if dpu and opt_device == "none":
            raise ConfigError(f"{key}.dpu", "the delayed parameter update overlaps the host "
                              'optimizer step; it needs offload_optimizer.device "cpu" or '
                              '"nvme"', value=True)
        return cls(optimizer=opt_device, param=par_device,
                   nvme_path=opt.nvme_path if opt is not None else None,
                   pin_memory=bool(opt is not None and opt.pin_memory),
                   param_nvme_path=par.nvme_path if par is not None else None,
                   param_pin_memory=bool(par is not None and par.pin_memory),
                   buffer_count=max(2, min(SWAP_SLOTS, opt.buffer_count)) if opt else SWAP_SLOTS,
                   delayed_update=dpu)
