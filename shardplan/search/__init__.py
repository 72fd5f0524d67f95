"""Strategy search on the solver-level :class:`Problem`.

``SOLVERS`` maps a solver name to a callable ``(problem, **opts) -> Solution``.
"""

from shardplan.search.dp import solve_dp
from shardplan.search.ilp import solve_ilp
from shardplan.search.io import load_problem, problem_from_dict, problem_to_dict, save_problem, solution_to_dict
from shardplan.search.mcmc import solve_mcmc
from shardplan.search.ordering import ORDERINGS
from shardplan.search.problem import Problem, Solution
from shardplan.search.reference import solve_bfs_dp, solve_bruteforce

__all__ = [
    "solve_dp",
    "solve_bruteforce",
    "solve_bfs_dp",
    "solve_ilp",
    "solve_mcmc",
    "ORDERINGS",
    "SOLVERS",
    "load_problem",
    "save_problem",
    "problem_to_dict",
    "problem_from_dict",
    "solution_to_dict",
    "Problem",
    "Solution",
]

SOLVERS = {
    "dp": solve_dp,
    "bruteforce": solve_bruteforce,
    "bfs-dp": solve_bfs_dp,
    "ilp": solve_ilp,
    "mcmc": solve_mcmc,
}
