"""Reporting: everything that turns plans and measurements into something to read.

* :mod:`~shardplan.report.text`: the Table II-style strategy table, the text
  report (step time, breakdown, memory, speedups) and the JSON form of a plan;
* :mod:`~shardplan.report.plot`: the speedup plot (matplotlib, imported on use);
* :mod:`~shardplan.report.dot`: Graphviz DOT of a graph or a plan.
"""

from shardplan.report.dot import graph_to_dot, plan_to_dot
from shardplan.report.plot import plot_speedups
from shardplan.report.summary import render_plan, render_report
from shardplan.report.text import Group, compress_names, group_operators, plan_to_json, render_strategy
from shardplan.table import format_table

__all__ = ["Group", "group_operators", "compress_names", "render_report", "render_plan", "render_strategy", "plan_to_json",
           "format_table", "plot_speedups", "graph_to_dot", "plan_to_dot"]
