"""A small pre-norm transformer for packed or padded token batches, and the exact,
weight-normalised losses and metrics it trains with.

Batch contract (what tfspeed's sequence batching produces)::

  inputs   {"tokens": int32 [B, T], "segment_ids": int32 [B, T], "positions": int32 [B, T]}
           segment_ids: 0 padding, 1..S which sequence of a packed row (1 everywhere real
           when unpacked; each sequence's tokens contiguous); positions: the index within
           its own sequence (< max_length).
  targets  classification {"label": int32 [B, S], "weight": float32 [B, S]}, weight 0 where
           a row holds no S-th sequence (S <= max_segments);
           lm {"label": int32 [B, T] next-token ids, "weight": float32 [B, T]}, weight 0 at
           padding.

Attention is segment-block-diagonal (plus causal for ``"lm"``) and positions restart per
sequence, so a sequence packed with others gets the outputs it gets alone.

Exactness under accumulation and several replicas. The loss of one update is the sum of
``weighted_sparse_ce`` over every element (token for lm, sequence for classification) of
the *global* batch, all K micro-batches on all R replicas, divided by W, the sum of their
weights. W varies from micro-batch to micro-batch, so averaging micro-batch means (exact for
fixed-size examples) over-weights the tokens of sparse micro-batches. An engine is exact if:

1. on each replica and micro-batch it takes the gradient of ``loss_sum / C`` (from
   ``weighted_loss_sum``; C a constant fixed in advance, e.g. the global token capacity
   ``R * B * T * K``, only to keep magnitudes like a mean's under a loss scale) and adds it,
   and ``weight_sum``, into SUM accumulators;
2. at apply time it all-reduces (SUM) the gradients and the weight sums and multiplies the
   gradients by ``C / W`` (``divide_no_nan``: W = 0 gives a zero update), before clipping;
3. adds regularisation-loss gradients once per update, outside the token sum;
4. reports ``sum(loss_sum) / sum(weight_sum)`` (and ``perplexity`` of it), not a mean of means.

``accumulated_gradients`` is that computation, written plainly, for engines to test against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import keras
from keras import ops

TASKS = ("classification", "lm")
INPUT_NAMES = ("tokens", "segment_ids", "positions")
# The element-wise work of one attention pair in one head (the mask, the softmax and their
# gradients), in multiply-adds of a matmul's cost: fitted to the train step's time per token
# at row widths 16 to 512 (width 64, 4 heads, 2 cores), where attention's share grows with
# the row as 1 + width / K.
PAIR_WORK_PER_HEAD = 19


def attention_length(width: int, depth: int, heads: int, outputs_per_token: int = 0) -> float:
    """K: the row length at which a token's attention pairs cost as much as its per-token
    work (its projections and MLP, and an lm's output layer over the vocabulary), so a
    token in a row of w positions costs ``1 + w / K`` per-token units. Every position of a
    row is attended to, the masked ones too: packing short texts into long rows pays for
    pairs that no segment uses.

    Args:
      width, depth, heads: the transformer's.
      outputs_per_token: logits computed per token (an lm's vocabulary; 0 for classification,
        which pools before its small head).
    """
    per_token = depth * 12 * width * width + outputs_per_token * width
    per_pair = depth * (2 * width + PAIR_WORK_PER_HEAD * heads)
    return per_token / per_pair


@keras.saving.register_keras_serializable(package="tfspeed")
class SegmentMask(keras.layers.Layer):
    """segment_ids [B, T] -> attention mask [B, T, T]: query i may attend to key j when both
    are real tokens of the same segment (and j <= i if ``causal``). A padding query attends
    only to itself, so no softmax row is empty whatever Keras does with one."""

    def __init__(self, causal: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.causal = causal

    def call(self, segment_ids):
        query = ops.expand_dims(segment_ids, 2)
        key = ops.expand_dims(segment_ids, 1)
        allowed = ops.logical_and(ops.equal(query, key), ops.not_equal(query, 0))
        index = ops.arange(ops.shape(segment_ids)[1])
        if self.causal:  # row order is sequence order: segments are contiguous
            earlier = ops.greater_equal(index[:, None], index[None, :])[None]
            allowed = ops.logical_and(allowed, earlier)
        padding_self = ops.logical_and(ops.equal(query, 0),
                                       ops.equal(index[:, None], index[None, :])[None])
        return ops.logical_or(allowed, padding_self)

    def compute_output_shape(self, input_shape):
        return (input_shape[0], input_shape[1], input_shape[1])

    def get_config(self):
        return {**super().get_config(), "causal": self.causal}


@keras.saving.register_keras_serializable(package="tfspeed")
class SegmentMeanPool(keras.layers.Layer):
    """[x [B, T, D], segment_ids [B, T]] -> the mean of each segment's tokens [B, S, D], in
    float32, as one one-hot matmul. Segment s lands at index s - 1; a segment with no tokens
    (and any id above ``max_segments``) gives zeros."""

    def __init__(self, max_segments: int, **kwargs):
        super().__init__(**kwargs)
        self.max_segments = max_segments

    def call(self, inputs):
        x, segment_ids = inputs
        x = ops.cast(x, "float32")
        members = ops.one_hot(segment_ids, self.max_segments + 1, dtype="float32")[..., 1:]
        sums = ops.einsum("bts,btd->bsd", members, x)
        counts = ops.expand_dims(ops.sum(members, axis=1), -1)
        return sums / ops.maximum(counts, 1.0)

    def compute_output_shape(self, input_shape):
        x_shape, _ = input_shape
        return (x_shape[0], self.max_segments, x_shape[-1])

    def get_config(self):
        return {**super().get_config(), "max_segments": self.max_segments}


def build_transformer(vocab_size: int, num_outputs: int, task: str, width: int = 64,
                      depth: int = 2, heads: int = 4, max_length: int = 512,
                      max_segments: int = 16, dropout: float = 0.0) -> keras.Model:
    """A pre-norm transformer over the batch contract's dict of inputs.

    Args:
      vocab_size: token ids are in [0, vocab_size).
      num_outputs: classes for ``"classification"``; the output vocabulary for ``"lm"``
        (must equal ``vocab_size``: labels are next-token ids).
      task: ``"classification"`` (one prediction per packed sequence) or ``"lm"`` (causal,
        one next-token prediction per position).
      width: model width; ``heads`` must divide it. The MLP is 4 x width, gelu.
      depth: number of blocks (LayerNorm -> attention -> residual; LayerNorm -> MLP ->
        residual), followed by a final LayerNorm.
      heads: attention heads.
      max_length: positions must be below it (learned position embedding).
      max_segments: classification only: sequences per row the head pools (S of the output).
      dropout: after the embeddings, in attention, and on each residual branch.

    Returns:
      A ``keras.Model`` giving float32 logits (its last Dense is float32 under any mixed
      policy): ``[B, max_segments, num_outputs]`` for classification (segment s at index
      s - 1; the losses use the first S the labels have), ``[B, T, vocab_size]`` for lm.
    """
    _check_arguments(vocab_size, num_outputs, task, width, heads, max_length, max_segments)
    inputs = {name: keras.Input((None,), dtype="int32", name=name) for name in INPUT_NAMES}
    tokens = keras.layers.Embedding(vocab_size, width, name="token_embedding")(inputs["tokens"])
    positions = keras.layers.Embedding(max_length, width, name="position_embedding")(
        inputs["positions"])
    x = _dropout(keras.layers.Add(name="embeddings")([tokens, positions]), dropout, "embed")
    mask = SegmentMask(causal=task == "lm", name="attention_mask")(inputs["segment_ids"])
    for i in range(depth):
        x = _block(x, mask, width, heads, dropout, f"block{i}")
    x = keras.layers.LayerNormalization(epsilon=1e-6, name="final_norm")(x)
    if task == "classification":
        x = SegmentMeanPool(max_segments, name="segment_pool")([x, inputs["segment_ids"]])
    logits = keras.layers.Dense(num_outputs, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name=f"transformer_{task}")


def _block(x, mask, width: int, heads: int, dropout: float, name: str):
    h = keras.layers.LayerNormalization(epsilon=1e-6, name=f"{name}_attention_norm")(x)
    h = keras.layers.MultiHeadAttention(heads, width // heads, dropout=dropout,
                                        name=f"{name}_attention")(h, h, attention_mask=mask)
    x = keras.layers.Add(name=f"{name}_attention_residual")([x, _dropout(h, dropout, name)])
    h = keras.layers.LayerNormalization(epsilon=1e-6, name=f"{name}_mlp_norm")(x)
    h = keras.layers.Dense(4 * width, activation="gelu", name=f"{name}_mlp_in")(h)
    h = keras.layers.Dense(width, name=f"{name}_mlp_out")(h)
    return keras.layers.Add(name=f"{name}_mlp_residual")([x, _dropout(h, dropout, f"{name}_mlp")])


def _dropout(x, rate: float, name: str):
    return keras.layers.Dropout(rate, name=f"{name}_dropout")(x) if rate else x


def _check_arguments(vocab_size, num_outputs, task, width, heads, max_length, max_segments):
    if task not in TASKS:
        raise ValueError(f"task {task!r} is not one of: {', '.join(TASKS)}")
    if task == "lm" and num_outputs != vocab_size:
        raise ValueError(f"an lm predicts next-token ids: num_outputs ({num_outputs}) must "
                         f"equal vocab_size ({vocab_size})")
    if width % heads:
        raise ValueError(f"heads ({heads}) must divide width ({width})")
    if min(vocab_size, num_outputs, max_length, max_segments) < 1:
        raise ValueError("vocab_size, num_outputs, max_length and max_segments must be >= 1")


# ------------------------------------------------------------------ losses and metrics
def _aligned(targets: dict, logits):
    """Labels, float32 weights and float32 logits of matching leading shape. Classification
    logits have ``max_segments`` columns; the labels' S (<= it) decides. Labels and logits
    under weight 0 (padding, absent sequences, the empty rows that fill a last evaluation
    batch) may be anything, NaN included: they become 0, so the loss stays finite. (A Keras
    model that masks padding, ``Embedding(mask_zero=True)``, and averages over the tokens
    of a row gives 0 / 0 for a row with none.) ``keras.ops``: the same on every backend."""
    weight = ops.cast(targets["weight"], "float32")
    label = ops.cast(targets["label"], "int32")
    logits = ops.cast(logits[:, : ops.shape(label)[1]], "float32")
    real = ops.greater(weight, 0)
    logits = ops.where(ops.expand_dims(real, -1), logits, ops.zeros_like(logits))
    return ops.where(real, label, ops.zeros_like(label)), weight, logits


def weighted_sparse_ce(targets: dict, logits):
    """Cross-entropy of each element times its weight: ``[B, T]`` for lm, ``[B, S]`` for
    classification. Not normalised: divide the sum by the GLOBAL ``weight_sum`` (see the
    module docstring)."""
    label, weight, logits = _aligned(targets, logits)
    return ops.sparse_categorical_crossentropy(label, logits, from_logits=True) * weight


def weight_sum(targets: dict):
    """The normaliser: real tokens (lm) or real sequences (classification) in ``targets``."""
    return ops.sum(ops.cast(targets["weight"], "float32"))


def weighted_loss_sum(targets: dict, logits):
    """``(sum of weighted_sparse_ce, weight_sum)`` of one (micro-)batch; both add across
    micro-batches and replicas, and their ratio over a global batch is its exact mean loss."""
    return ops.sum(weighted_sparse_ce(targets, logits)), weight_sum(targets)


def weighted_correct(targets: dict, logits):
    """1.0 times the weight where the arg-max logit is the label, per element."""
    label, weight, logits = _aligned(targets, logits)
    hit = ops.equal(ops.cast(ops.argmax(logits, axis=-1), "int32"), label)
    return ops.cast(hit, "float32") * weight


def correct_sum(targets: dict, logits):
    """``(correct, weight_sum)``: their ratio is token accuracy for lm, sequence accuracy
    for classification; like the loss, sum both over the global batch before dividing."""
    return ops.sum(weighted_correct(targets, logits)), weight_sum(targets)


def perplexity(loss_sum, total_weight):
    """exp(mean loss per real token) from summed losses and weights (1.0 for no tokens)."""
    total = ops.cast(total_weight, "float32")
    mean = ops.where(ops.greater(total, 0), ops.cast(loss_sum, "float32")
                     / ops.maximum(total, 1e-30), 0.0)
    return ops.exp(mean)


def accumulated_gradients(
    model: keras.Model, batches: Iterable[tuple[dict, dict]],
    loss_sum_fn: Callable = weighted_loss_sum,
) -> tuple[list, object]:
    """Reference for engines: the exact gradient and loss of the global weighted mean over
    all ``batches`` (micro-batches, or micro-batches of all replicas), taken one at a time.

    Args:
      model: the model; its trainable variables are differentiated.
      batches: ``(inputs, targets)`` pairs; their numbers of real tokens may differ.
      loss_sum_fn: ``(targets, logits) -> (loss_sum, weight_sum)``.

    Returns:
      ``(gradients, loss)``: summed per-batch gradients of ``loss_sum`` divided by the total
      weight, which equal the gradient of one batch holding all of them; and that mean loss.
    """
    import tensorflow as tf  # the reference differentiates with TensorFlow's tape

    total_grads, total_loss, total_weight = None, 0.0, 0.0
    for inputs, targets in batches:
        with tf.GradientTape() as tape:
            loss_sum, weights = loss_sum_fn(targets, model(inputs, training=True))
        grads = [tf.convert_to_tensor(g)
                 for g in tape.gradient(loss_sum, model.trainable_variables)]
        total_grads = grads if total_grads is None else [
            a + g for a, g in zip(total_grads, grads, strict=True)]
        total_loss += loss_sum
        total_weight += weights
    return ([tf.math.divide_no_nan(g, total_weight) for g in total_grads],
            tf.math.divide_no_nan(total_loss, total_weight))
