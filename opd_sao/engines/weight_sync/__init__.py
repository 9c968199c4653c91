"""Weight-sync modes, one registered class per file (`base.WeightSyncMode`): disk, tensor, distributed."""
from opd_sao.registry import import_submodules

from .base import WEIGHT_SYNCS, SyncSettings, WeightSyncMode, WeightSyncRefused, untied

import_submodules(__name__, __path__)

__all__ = ["WEIGHT_SYNCS", "SyncSettings", "WeightSyncMode", "WeightSyncRefused", "untied"]
