"""uint8 images to the device, scaled inside the compiled step.

A float32 batch is 4× the bytes of the uint8 one it was scaled from. On an accelerator the
copy to the device, not decoding, is what limits a small model: MobileNetV2 on an H100 ran at
0.47× its uint8 rate fed float32 batches (issue 37's measurements). The driver, ``tfspeed.fit``
on ``tfspeed.data.build(..., image_dtype="uint8")`` batches and tune send uint8 and scale in
the step; for a model and ``fit`` of your own, put ``scaling_layer()`` first in the model.
"""

from __future__ import annotations

SCALE = 1 / 255  # uint8 to [0, 1], as the float32 pipeline scales


def scale(x):
    """uint8 images to float32 in [0, 1] (``keras.ops``: inside any backend's step)."""
    import keras

    return keras.ops.cast(x, "float32") * SCALE


def scaling_layer(name: str = "scale_images"):
    """The layer to put first in your own model when its input comes from
    ``tfspeed.data.build(..., image_dtype="uint8")``: it computes what the float32 pipeline
    would have sent, inside the compiled step, so 4× fewer bytes travel to the device.

        x = keras.Input((224, 224, 3), dtype="uint8")
        y = base_model(tfspeed.data.scaling_layer()(x))
    """
    import keras

    return keras.layers.Rescaling(SCALE, name=name)


def float_images_advice(fix: str) -> str:
    """What diagnose and ``tfspeed.fit`` say when float32 images go to the device."""
    return f"float32 images sent to the device: 4x the bytes of uint8; {fix}"
