"""Pipeline stages: schedules and their cost, the exact search over stages, reports and timelines.

The names below are imported from their modules on first use (PEP 562), so that building the command
line parser (which only adds the ``pipeline`` command) does not import the stage search.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["pipeline_solve", "PipelineResult", "PipelinePlan", "PipelineSpace", "StageCost", "StageTimes",
           "ModelStages", "SCHEDULES", "search_pipeline", "submesh_sizes", "units_of", "step_time", "in_flight",
           "bubble_fraction", "simulate"]

_HOME = {
    "pipeline_solve": "api", "PipelineResult": "api",
    "SCHEDULES": "schedule", "StageTimes": "schedule", "bubble_fraction": "schedule", "in_flight": "schedule",
    "simulate": "schedule", "step_time": "schedule",
    "PipelinePlan": "search", "PipelineSpace": "search", "StageCost": "search", "search_pipeline": "search",
    "submesh_sizes": "search",
    "ModelStages": "stages", "units_of": "stages",
}


def __getattr__(name: str) -> Any:
    """A public name from its module (imported now), or a submodule of the package."""
    if name in _HOME:
        value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
