"""The keras.applications backbones tfspeed offers, built and trained for one real step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfspeed.data
from tfspeed.config import ModelConfig
from tfspeed.training import models
from tfspeed.training.backends.tensorflow import TensorFlowEngine as Engine


def _cross_entropy(labels, logits):
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)


@pytest.mark.parametrize("name", ["resnet50", "mobilenetv2"])
def test_application_backbones_build_at_32px_and_train_one_step(photos_dir, name):
    """At 32x32x3, the smallest input keras.applications allows, on the converted photos.

    The engine's tf.functions run eagerly here: tracing ResNet50's train step takes ~40 s on
    2 cores, running it eagerly ~4 s. The step's code is the same; its graph build is what
    the engine's other tests (tiny models) cover."""
    keras.utils.set_random_seed(0)
    train = tfspeed.data.build(photos_dir, "train", 4, training=True, image_size=32,
                               image_dtype="uint8", cache="none")
    strategy = tf.distribute.get_strategy()
    batches = iter(strategy.experimental_distribute_dataset(train))
    model = models.build(ModelConfig(name=name), (32, 32, 3), num_classes=3)
    assert model.output_shape == (None, 3)
    tf.config.run_functions_eagerly(True)
    try:
        engine = Engine(model, keras.optimizers.SGD(0.01), strategy, _cross_entropy,
                        global_batch_size=4, preprocess=lambda x: tf.cast(x, tf.float32) / 255)
        before = [w.copy() for w in model.get_weights()]
        out = engine.train(batches, steps=1)
    finally:
        tf.config.run_functions_eagerly(False)
    assert int(out["updates"]) == 1 and np.isfinite(float(out["loss"]))
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights(),
                                                        strict=True))
    x, _ = next(batches)
    logits = model(tf.cast(x, tf.float32) / 255, training=False)
    assert logits.shape == (4, 3) and np.isfinite(logits.numpy()).all()
