"""Controller process: aggregates telemetry, serves cluster status, runs FluidRole."""

from services.controller.config import ControllerConfig
from services.controller.controller import Controller

__all__ = ["Controller", "ControllerConfig"]
