"""Residency policies of the adapter store, chosen once by name when the store is made:
`tiered` (host memory, then a bounded pool of compute slots; GPUs) and `unified` (one adapter
memory; CPU). base.py states what a policy decides."""

from loraserve.adapters.residency.base import (
    PinLimit,
    Residency,
    ResidencyLimits,
    SlotPool,
)
from loraserve.adapters.residency.tiered import TieredResidency
from loraserve.adapters.residency.unified import UnifiedResidency

RESIDENCIES: dict[str, type[Residency]] = {TieredResidency.name: TieredResidency,
                                           UnifiedResidency.name: UnifiedResidency}


def residency_class(name: str) -> type[Residency]:
    try:
        return RESIDENCIES[name]
    except KeyError:
        raise ValueError(f"unknown adapter memory {name!r}: choose from {sorted(RESIDENCIES)}"
                         " (settle 'auto' with EngineConfig.resolve first)") from None


__all__ = ["RESIDENCIES", "PinLimit", "Residency", "ResidencyLimits", "SlotPool",
           "TieredResidency", "UnifiedResidency", "residency_class"]
