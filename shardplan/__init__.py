"""shardplan: exact search for the fastest way to split a DNN training step."""

from shardplan.errors import ShardplanError

__all__ = ["ShardplanError"]
__version__ = "0.1.0"
