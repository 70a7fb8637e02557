"""What to offload where, read once from ``zero_optimization`` and checked against the stage."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError

SWAP_SLOTS = 3   # NVMe: one record being read, one stepped, one written back
# Largest record the host steps at once (elements): small enough that the host's work on
# the first records overlaps the rest of backward and that the last record's step and
# upload, which nothing hides, stay short (20 ms of CPU Adam at 2.5 G params/s); large
# enough that a reduce-scatter of one bucket still runs at bandwidth (100 MB in bf16).
OFFLOAD_RECORD_NUMEL = 50_000_000


@dataclass(frozen=True)
class OffloadPlan:
    """optimizer: where fp32 masters and optimizer state live ("none", "cpu", "nvme").
    param: where stage-3 parameter shards live between uses ("none", "cpu", "nvme").
    delayed_update: step on the host while the next micro-batches run (``dpu``).
    speculative: step each record on the host as its gradient lands during backward,
    validated after it (``offload/speculation.py``).
    trace_path: where to write the host step's per-record timeline (``offload/trace.py``).
    ratio: the fraction of the records offloaded (DeepSpeed's key): the first ``1 - ratio``
    of them keep their state on the device and are stepped there (``records_on_device``).
    """

    optimizer: str = "none"
    param: str = "none"
    nvme_path: Optional[str] = None
    pin_memory: bool = False
    param_nvme_path: Optional[str] = None
    param_pin_memory: bool = False
    buffer_count: int = SWAP_SLOTS
    delayed_update: bool = False
    speculative: bool = False
    trace_path: Optional[str] = None
    ratio: float = 1.0

    def record_numel(self, bucket_numel: int) -> int:
        """The gradient bucket size, in elements, at stages 1-2: the record the host steps
        at a time when the optimizer is offloaded is one bucket, so it is capped at
        ``OFFLOAD_RECORD_NUMEL`` there (Note "record size" in docs/offload.md)."""
        if not self.optimizer_offloaded:
            return bucket_numel
        return min(bucket_numel, OFFLOAD_RECORD_NUMEL)

    def records_on_device(self, records: int) -> int:
        """How many of ``records`` (in layout order) keep their fp32 state on the device:
        DeepSpeed's split of its sub-groups, ``int((1 - ratio) * n)``, the first ones
        (stage 3's ``subgroup_to_device``: sub-group i goes to the host from that index on).
        The last records' gradients arrive first in backward, so the host steps those
        while the rest of backward runs."""
        if not self.optimizer_offloaded:
            return records
        return int((1 - self.ratio) * records)

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
        if par is not None and par.device != "none" and par.ratio != 1.0:
            raise ConfigError("zero_optimization.offload_param.ratio", "partial parameter "
                              'offload is not supported; use 1.0 (all) or device "none"',
                              value=par.ratio)
        ratio = opt.ratio if opt is not None and opt_device != "none" else 1.0
        if ratio != 1.0 and (opt_device != "cpu" or (opt and opt.dpu)):
            raise ConfigError(f"{key}.ratio", "partial optimizer offload (the first "
                              "1 - ratio of the records stepped on the device) is supported "
                              'with device "cpu", without dpu; use 1.0 here', value=ratio)
        if ratio != 1.0 and par_device != "none":
            raise ConfigError(f"{key}.ratio", "partial optimizer offload keeps some fp32 "
                              "masters on the device, but offload_param keeps the parameter "
                              "shards on the host, where their masters must be too; use "
                              'ratio 1.0 or offload_param.device "none"', value=ratio)
        dpu = bool(opt is not None and opt.dpu)
        if dpu and opt_device == "none":
            raise ConfigError(f"{key}.dpu", "the delayed parameter update overlaps the host "
                              'optimizer step; it needs offload_optimizer.device "cpu" or '
                              '"nvme"', value=True)
        speculative = bool(opt is not None and opt.speculative)
        trace_path = opt.trace_path if opt is not None else None
        for name, value in (("speculative", speculative), ("trace_path", trace_path)):
            if value and opt_device == "none":
                raise ConfigError(f"{key}.{name}", "concerns the host optimizer step; it "
                                  'needs offload_optimizer.device "cpu" or "nvme"',
                                  value=value)
        if speculative and dpu:
            raise ConfigError(f"{key}.speculative", "the delayed parameter update already "
                              "steps the host during the next forward and backward; use one "
                              "of speculative and dpu", value=True)
        return cls(optimizer=opt_device, param=par_device,
                   nvme_path=opt.nvme_path if opt is not None else None,
                   pin_memory=bool(opt is not None and opt.pin_memory),
                   param_nvme_path=par.nvme_path if par is not None else None,
                   param_pin_memory=bool(par is not None and par.pin_memory),
                   buffer_count=max(2, min(SWAP_SLOTS, opt.buffer_count)) if opt else SWAP_SLOTS,
                   delayed_update=dpu, speculative=speculative, trace_path=trace_path,
                   ratio=ratio)
