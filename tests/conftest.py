import os
import sys

# JAX tests run on 8 simulated CPU devices; the flag must be set before jax is first imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

sys.path.insert(0, os.path.dirname(__file__))

