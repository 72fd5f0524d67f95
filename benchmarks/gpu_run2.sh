#!/bin/bash
# The sections of gpu_run.sh that ran past their limits there (the flax steps under XLA, torch.compile), each in
# its own process with a longer limit; run right after it on the same machine.
export PYTHONPATH=$PWD
timeout 320 python3 benchmarks/gpu_measure.py --out $OUT/jax --sections jax_steps > $OUT/jax.log 2>&1; echo "rc=$?"; grep -v "^row" $OUT/jax.log | tail -4
timeout 130 python3 benchmarks/gpu_measure.py --out $OUT/compiled --sections compiled_steps > $OUT/compiled.log 2>&1; echo "rc=$?"; grep "^step" $OUT/compiled.log
