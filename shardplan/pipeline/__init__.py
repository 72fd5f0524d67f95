"""Pipeline stages: schedules and their cost, the exact search over stages, reports and timelines."""

from shardplan.pipeline.api import PipelineResult, pipeline_solve
from shardplan.pipeline.schedule import SCHEDULES, StageTimes, bubble_fraction, in_flight, simulate, step_time
from shardplan.pipeline.search import PipelinePlan, PipelineSpace, StageCost, search_pipeline, submesh_sizes
from shardplan.pipeline.stages import ModelStages, units_of

__all__ = ["pipeline_solve", "PipelineResult", "PipelinePlan", "PipelineSpace", "StageCost", "StageTimes",
           "ModelStages", "SCHEDULES", "search_pipeline", "submesh_sizes", "units_of", "step_time", "in_flight",
           "bubble_fraction", "simulate"]
