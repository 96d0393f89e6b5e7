"""Energy meters, the sampler, tokens-per-joule accounting, the energy log and its metrics.

Knows nothing of the model: the engine reports steps (start, end, tokens per request) and this
package turns them into joules per request. Never imports torch or o3edge.engine.
"""

from o3edge.power.accountant import DEFAULT_PREFILL_WEIGHT, EnergyAccountant
from o3edge.power.composite_meter import PREFERENCES, CompositeMeter, auto_meter
from o3edge.power.energy_log import EnergyLog
from o3edge.power.estimate_meter import EstimateMeter
from o3edge.power.jetson_meter import JetsonMeter
from o3edge.power.meter import Meter, MeterUnavailable, Reading
from o3edge.power.nvml_meter import NvmlMeter
from o3edge.power.rapl_meter import RaplMeter
from o3edge.power.records import EnergyTotals, RequestEnergy, StepTokens
from o3edge.power.sampler import EnergySampler, EnergyWindow

__all__ = [
    "DEFAULT_PREFILL_WEIGHT", "PREFERENCES", "CompositeMeter", "EnergyAccountant", "EnergyLog", "EnergySampler",
    "EnergyTotals", "EnergyWindow", "EstimateMeter", "JetsonMeter", "Meter", "MeterUnavailable", "NvmlMeter",
    "RaplMeter", "Reading", "RequestEnergy", "StepTokens", "auto_meter",
]
