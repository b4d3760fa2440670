"""The user's model behind a layer that scales uint8 images as their pipeline did, op for op
(``tfspeed.optimize(ds, model)``; ``dtypes`` finds the scale). Its own module: Keras loads only
where a model is given.

A model saved from the returned one reloads where this module is imported (its layer is
registered as ``tfspeed>UintScale``); the user's own model, whose weights it trains, saves and
reloads in stock Keras as before.
"""

from __future__ import annotations

import keras
import numpy as np


@keras.saving.register_keras_serializable(package="tfspeed")
class UintScale(keras.layers.Layer):
    """Takes uint8 images and gives what the pipeline's cast and steps gave, by looking each
    value up in their table (``dtypes.table``: ``values[v * n + p]`` for value ``v`` at
    position ``p`` of ``shape``, the constants' broadcast shape of ``n`` positions). Exact on
    every backend and compiler, where computing it is not (XLA and Grappler turn ``x / 255``
    into ``x * (1/255)``). A saved model holds the table in its weights.
    """

    def __init__(self, shape=(), out_dtype: str = "float32", values=None, **kwargs):
        kwargs.pop("dtype", None)  # a saved config holds it: it is out_dtype
        super().__init__(dtype=out_dtype, **kwargs)
        self.shape, self.out_dtype, self._given = tuple(shape), out_dtype, values
        self._positions = np.arange(max(1, int(np.prod(self.shape))), dtype=np.int32).reshape(
            self.shape)

    def build(self, input_shape):
        self.values = self.add_weight(shape=(256 * self._positions.size,), dtype=self.out_dtype,
                                      initializer="zeros", trainable=False, name="table")
        if self._given is not None:
            self.values.assign(self._given)

    def call(self, x):
        index = keras.ops.cast(x, "int32")
        if self._positions.size > 1:  # per channel (or position): value * n + position
            index = index * self._positions.size + self._positions
        return keras.ops.take(self.values, index)

    def compute_output_spec(self, x):
        return keras.KerasTensor(x.shape, dtype=self.out_dtype)

    def get_config(self):
        return {**super().get_config(), "shape": list(self.shape), "out_dtype": self.out_dtype}


def uint8_model(tables: dict, model, spec):
    """A Keras model that takes the uint8 images of ``spec`` (a uint8 pipeline's element_spec),
    gives them the values of ``tables`` (by flat position in an element: ``(values, shape,
    dtype)``) and calls ``model``: its layers, so training either trains both. Compiled as
    ``model`` was, with its optimizer.

    Returns:
      The model, or why not in words.
    """
    import tensorflow as tf

    for name in ("train_step", "test_step", "compute_loss"):
        if getattr(type(model), name) is not getattr(keras.Model, name):
            return (f"the model overrides {name}, which a model around it would not call: "
                    "scale inside your model to send uint8")
    x_spec = spec[0] if isinstance(spec, tuple) else spec
    leaves = tf.nest.flatten(x_spec)
    if any(i >= len(leaves) for i in tables):
        return "its scaled images are not the model's input (the x of (x, y))"
    if any(s.shape.rank is None or s.shape.rank < 2 for s in leaves):
        return "its elements are not batches of images of a known rank"
    inputs = [keras.Input(shape=s.shape[1:], dtype=s.dtype.name) for s in leaves]
    scaled = [UintScale(tables[i][1], tables[i][2], tables[i][0])(x) if i in tables else x
              for i, x in enumerate(inputs)]
    outputs = model(tf.nest.pack_sequence_as(x_spec, scaled))
    adapted = keras.Model(tf.nest.pack_sequence_as(x_spec, inputs), outputs,
                          name=f"{model.name}_uint8")
    config = getattr(getattr(model, "_compile_config", None), "config", None)
    if getattr(model, "compiled", False) and config:
        adapted.compile(**{**config, "optimizer": model.optimizer})
    return adapted
