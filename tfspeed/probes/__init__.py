"""What a step costs, below the packages that use it: the in-run probes (``autotune``: steps
per execution, precision, bucket against pack; ``profiling``: the profiler window and its
summary) and the step's cost model (``costs``). The training loop and the job call them,
``data.text`` predicts with the cost model, tune and diagnose measure with them; they import
nothing of those packages (nor TensorFlow at import), so the imports go one way."""
