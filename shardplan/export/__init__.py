"""Exports of graphs and plans to other tools (Graphviz DOT, ...)."""
