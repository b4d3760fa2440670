"""Model registry: name -> builder. Builders know nothing of strategies, precision or data files.

Every model maps an input of ``input_shape`` to ``num_classes`` logits from a float32 Dense
layer: under a mixed-precision policy the classifier (and so the softmax inside the loss)
stays float32, which keeps the loss numerically sound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import keras
import numpy as np

from tfspeed.config import ModelConfig
from tfspeed.errors import UsageError

Builder = Callable[[ModelConfig, Sequence[int], int], keras.Model]


@keras.saving.register_keras_serializable(package="tfspeed")
class RematBlock(keras.layers.Layer):
    """Runs ``inner`` under ``tf.recompute_grad``: its activations are recomputed in the
    backward pass instead of kept, so only the block's input and output stay in memory.

    Keras' own ``RematScope`` fails inside ``tf.function`` on the TF backend ("The
    custom_gradient decorator currently supports keywords arguments only when eager
    execution is enabled"), because it passes ``training=`` through; here ``training`` is
    closed over and the recomputed function takes one positional tensor.
    """

    def __init__(self, inner: keras.layers.Layer, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def build(self, input_shape):
        self.inner.build(input_shape)

    def call(self, x, training=None):
        # Keras' remat: jax.checkpoint on JAX, tf.recompute_grad on TensorFlow.
        return keras.remat(lambda t: self.inner(t, training=training))(x)

    def compute_output_shape(self, input_shape):
        return self.inner.compute_output_shape(input_shape)

    def get_config(self):
        return {**super().get_config(), "inner": keras.saving.serialize_keras_object(self.inner)}

    @classmethod
    def from_config(cls, config):
        inner = keras.saving.deserialize_keras_object(config.pop("inner"))
        return cls(inner, **config)


def block(layers: Sequence[keras.layers.Layer], remat: bool, name: str) -> keras.layers.Layer:
    """A model block: the unit ``--remat`` recomputes (so the unit of memory saved)."""
    inner = keras.Sequential(list(layers), name=name)
    return RematBlock(inner, name=f"{name}_remat") if remat else inner


def _classifier(x, config: ModelConfig, num_classes: int):
    if config.dropout:
        x = keras.layers.Dropout(config.dropout)(x)
    return keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)


def build_mlp(config: ModelConfig, input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """Two hidden ReLU layers on the flattened input (tabular data, tiny images)."""
    width = config.width or 256
    inputs = keras.Input(tuple(input_shape), name="inputs")
    x = keras.layers.Flatten()(inputs)
    hidden = [keras.layers.Dense(width, activation="relu") for _ in range(2)]
    x = block(hidden, config.remat, "hidden")(x)
    return keras.Model(inputs, _classifier(x, config, num_classes), name="mlp")


def build_cnn(config: ModelConfig, input_shape: Sequence[int], num_classes: int) -> keras.Model:
    """A small VGG-style CNN: two conv blocks, global pooling, classifier."""
    _require_image(input_shape, "cnn")
    width = config.width or 32
    inputs = keras.Input(tuple(input_shape), name="inputs")
    x = inputs
    for i, filters in enumerate((width, width * 2)):
        convs = [keras.layers.Conv2D(filters, 3, padding="same", activation="relu")
                 for _ in range(2)]
        x = block(convs, config.remat, f"conv_block{i}")(x)
        if i == 0 and min(input_shape[:2]) >= 8:
            x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, _classifier(x, config, num_classes), name="cnn")


def _application(name: str, factory: Callable[..., keras.Model], min_side: int) -> Builder:
    def build(config: ModelConfig, input_shape: Sequence[int], num_classes: int) -> keras.Model:
        _require_image(input_shape, name)
        if input_shape[-1] != 3 or min(input_shape[:2]) < min_side:
            raise UsageError(
                f"--model={name} needs RGB images of at least {min_side}x{min_side}; the data "
                f"gives {tuple(input_shape)}: pass --image_size={max(min_side, 224)} or another --model"
            )
        if config.remat:
            raise UsageError(f"--remat recomputes tfspeed's model blocks (mlp, cnn); {name} from "
                             "keras.applications has no block boundaries here: drop --remat")
        inputs = keras.Input(tuple(input_shape), name="inputs")
        # weights=None: no download (and these machines have no hub access).
        backbone = factory(include_top=False, weights=None, input_tensor=inputs, pooling="avg")
        return keras.Model(inputs, _classifier(backbone.output, config, num_classes), name=name)

    return build


def _require_image(input_shape: Sequence[int], name: str) -> None:
    if len(input_shape) != 3:
        raise UsageError(
            f"--model={name} needs image inputs (height, width, channels); the data gives "
            f"shape {tuple(input_shape)}: use --model=mlp"
        )


def build_transformer(config: ModelConfig, input_shape, num_classes: int,
                      text: dict | None = None) -> keras.Model:
    """The pre-norm transformer (``tfspeed.training.transformer``) over a token schema's
    dict input. ``text``: ``vocab_size``, ``task``, ``max_length`` and ``max_segments``
    (from the schema and the resolved batching)."""
    from tfspeed.training import transformer

    if not text:
        raise UsageError("--model=transformer takes token records (text): convert text with "
                         "scripts/to_tfrecord.py --source=textfolder:... (or jsonl:, csv:)")
    width, heads = config.width or 64, config.heads or 4
    if width % heads:
        raise UsageError(f"--heads={heads} must divide --width={width}")
    return transformer.build_transformer(
        int(text["vocab_size"]), num_classes, text["task"], width=width, depth=config.depth or 2,
        heads=heads, max_length=int(text["max_length"]), max_segments=int(text["max_segments"]),
        dropout=config.dropout)


MODELS: dict[str, Builder] = {
    "mlp": build_mlp,
    "cnn": build_cnn,
    "resnet50": _application("resnet50", keras.applications.ResNet50, 32),
    "mobilenetv2": _application("mobilenetv2", keras.applications.MobileNetV2, 32),
    "transformer": build_transformer,
}


def build(config: ModelConfig, input_shape, num_classes: int,
          text: dict | None = None) -> keras.Model:
    """Builds the model named by ``config.name``: one of ``MODELS``, or the user's own
    ``package.module:function`` (``function(input_shape, num_outputs) -> keras.Model``).

    Args:
      config: which model, its width and dropout (and the transformer's depth and heads).
      input_shape: shape of one input example (no batch dimension); a dict name -> shape
        for several named inputs.
      num_classes: the outputs the task needs (classes, regression targets, or an lm's
        vocabulary).
      text: for token records: ``vocab_size``, ``task``, ``max_length``, ``max_segments``.
        Their input is ``{"tokens", "segment_ids", "positions"}``, each int32 of shape
        ``(None,)`` (the batch contract of ``tfspeed.data.sequences``); a user's function
        gets that dict as ``input_shape`` and must return logits ``[batch, S, num_outputs]``
        for classification (S >= 1: one per sequence of a row, as ``segment_ids`` 1..S
        number them; S = 1 unless packed) or ``[batch, T, num_outputs]`` for an lm.

    Returns:
      A ``keras.Model``; tfspeed's own produce float32 logits.
    """
    if is_user_model(config.name):
        return build_user_model(config.name, input_shape, num_classes, text)
    if config.name not in MODELS:
        raise UsageError(f"--model={config.name!r} is not one of: {', '.join(MODELS)} "
                         "(or your own, as package.module:function)")
    if config.name == "transformer" or text:
        if config.name != "transformer":
            raise UsageError(f"--model={config.name} does not take token records (text); use "
                             "--model=transformer or your own model (package.module:function)")
        return build_transformer(config, input_shape, num_classes, text)
    if isinstance(input_shape, dict):
        if config.name != "mlp":
            raise UsageError(f"--model={config.name} takes one input; the data has several "
                             f"({', '.join(input_shape)}): use --model=mlp or your own model")
        return build_mlp_named(config, input_shape, num_classes)
    return MODELS[config.name](config, input_shape, num_classes)


def is_user_model(name: str) -> bool:
    return ":" in name


def attention_length(config: ModelConfig, task: str, num_outputs: int) -> float | None:
    """The built-in transformer's K (``transformer.attention_length``: what attention over a
    row of w positions costs relative to a token's other work, 1 + w / K); None for a model
    whose attention tfspeed does not know."""
    if config.name != "transformer":
        return None
    from tfspeed.training import transformer

    return transformer.attention_length(config.width or 64, config.depth or 2,
                                        config.heads or 4,
                                        num_outputs if task == "lm" else 0)


def takes_segments(name: str) -> bool:
    """Whether model ``name`` keeps packed sequences apart (segment ids): the built-in
    transformer does; a user's model is not assumed to."""
    return name == "transformer"


def build_user_model(spec: str, input_shape, num_outputs: int,
                     text: dict | None = None) -> keras.Model:
    """Calls the user's ``function(input_shape, num_outputs)`` and checks what comes back.

    For token records ``input_shape`` is ``{"tokens": (None,), "segment_ids": (None,),
    "positions": (None,)}`` (int32 [batch, T] each, see ``build``)."""
    from tfspeed.training.objectives import load_callable

    if text:
        return _build_user_text_model(load_callable(spec, "model"), spec, input_shape,
                                      num_outputs)

    model = load_callable(spec, "model")(input_shape, num_outputs)
    if not isinstance(model, keras.Model):
        raise UsageError(f"--model={spec} returned {type(model).__name__}, not a keras.Model; "
                         "return one from function(input_shape, num_outputs)")
    # One call on a single zero example builds a subclassed model too (compute_output_shape
    # is not defined for those) and tells the output shape. NumPy: any backend takes it.
    zeros = ({name: np.zeros([1, *s], "float32") for name, s in input_shape.items()}
             if isinstance(input_shape, dict) else np.zeros([1, *input_shape], "float32"))
    shape = (None, *keras.tree.flatten(model(zeros))[0].shape[1:])
    if len(shape) != 2 or shape[-1] != num_outputs:
        raise UsageError(f"--model={spec} outputs shape {shape}, the task needs (None, "
                         f"{num_outputs}): end the model with keras.layers.Dense({num_outputs})")
    return model


def build_mlp_named(config: ModelConfig, input_shapes: dict, num_classes: int) -> keras.Model:
    """The MLP over several named inputs, concatenated."""
    inputs = {name: keras.Input(tuple(shape), name=name) for name, shape in input_shapes.items()}
    x = keras.layers.Concatenate()([keras.layers.Flatten()(t) for t in inputs.values()])
    width = config.width or 256
    hidden = [keras.layers.Dense(width, activation="relu") for _ in range(2)]
    x = block(hidden, config.remat, "hidden")(x)
    return keras.Model(inputs, _classifier(x, config, num_classes), name="mlp")


def _build_user_text_model(function, spec: str, input_shape, num_outputs: int) -> keras.Model:
    model = function(input_shape, num_outputs)
    if not isinstance(model, keras.Model):
        raise UsageError(f"--model={spec} returned {type(model).__name__}, not a keras.Model; "
                         "return one from function(input_shape, num_outputs)")
    ones = np.ones([1, 8], "int32")  # one real sequence of 8 tokens
    probe = {"tokens": ones, "segment_ids": ones, "positions": np.arange(8, dtype="int32")[None]}
    shape = (None, *keras.tree.flatten(model(probe))[0].shape[1:])
    if len(shape) != 3 or shape[-1] != num_outputs:
        raise UsageError(f"--model={spec} outputs shape {shape}; token records need logits "
                         f"(batch, S, {num_outputs}) for classification (S sequences per row) "
                         f"or (batch, T, {num_outputs}) for an lm")
    return model
