"""Each Keras backend's engine adapter (``tfspeed.training.engine.Engine``): placement,
compiling, the loop of steps per call and the checkpoint state around ``training.step``.
``tfspeed.runtime.backends`` says which one a backend uses."""
