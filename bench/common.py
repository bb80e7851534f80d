"""What the timing benchmarks share: config overrides that leave only the training steps to time.

Each script runs as ``python bench/NAME.py``, so this folder is on ``sys.path``.
"""

# No evaluation, no checkpoint, no progress bar, no TensorBoard: nothing but the steps.
TIMING_ONLY = ["run.eval_interval=0", "data.eval_batches=0", "checkpoint.interval=0",
               "checkpoint.at_end=false", "log.progress=false", "log.tensorboard=false"]
