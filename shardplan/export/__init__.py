"""Plans out to the tools that run them: JAX shardings (:mod:`.jax`) and the collectives of compiled XLA HLO (:mod:`.hlo`)."""
