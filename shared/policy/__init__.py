"""Policy layer: predictors, pressure signals, FluidToken (Algorithm 1), FluidRole rules.

Pure code — no I/O (except explicit load/save helpers), no asyncio, no torch, and no imports
from the engine or the services — so the simulator, the emulated engine and the services all
run the very same functions. Times are seconds, lengths tokens, ``now_s`` always passed in.
"""

from shared.policy.calibration import (
    fit_decode,
    fit_linear,
    fit_prefill,
    fit_profile,
    fit_suffix,
    mean_relative_error,
)
from shared.policy.config import PolicyConfig
from shared.policy.errors import PolicyConfigError, ProfileFormatError
from shared.policy.fluidrole import (
    ClusterSnapshot,
    Decision,
    RolePolicy,
    WorkerView,
)
from shared.policy.fluidtoken import StealBudget, StealPlan, select_steal_ratios
from shared.policy.predictors import LatencyProfile, example_profile
from shared.policy.prefill_pressure import QueuedRequest, queue_ppi, request_ppis
from shared.policy.pressure import DecodeLoad, DecodePressure, decode_pressure
from shared.policy.recalibration import EWLinearEstimator, OnlineRecalibrator
from shared.policy.window import KeyedWindows, SlidingWindow

__all__ = [
    "ClusterSnapshot",
    "Decision",
    "DecodeLoad",
    "DecodePressure",
    "EWLinearEstimator",
    "KeyedWindows",
    "LatencyProfile",
    "OnlineRecalibrator",
    "PolicyConfig",
    "PolicyConfigError",
    "ProfileFormatError",
    "QueuedRequest",
    "RolePolicy",
    "SlidingWindow",
    "StealBudget",
    "StealPlan",
    "WorkerView",
    "decode_pressure",
    "example_profile",
    "fit_decode",
    "fit_linear",
    "fit_prefill",
    "fit_profile",
    "fit_suffix",
    "mean_relative_error",
    "queue_ppi",
    "request_ppis",
    "select_steal_ratios",
]
