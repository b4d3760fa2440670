"""What a training step does to a batch besides the model, in ``keras.ops``: the same code
inside both backends' steps (``training.backends``; ``training.step`` builds on it).

Token batches are the dict contract of ``tfspeed.data.sequences`` (``segment_ids`` 0 at
padding, targets ``{"label", "weight"}``).
"""

from __future__ import annotations

from collections.abc import Mapping

from keras import ops, tree


def token_counts(x):
    """int32 ``[real tokens, computed tokens, sequences]`` of a token batch (a dict with
    ``segment_ids``, 0 at padding), or None for any other input (known when traced)."""
    if not isinstance(x, Mapping) or "segment_ids" not in x:
        return None
    segments = x["segment_ids"]
    real = ops.greater(segments, 0)
    # A sequence starts where a real token's segment id differs from its left neighbour's.
    previous = ops.pad(segments[:, :-1], [[0, 0], [1, 0]])
    starts = ops.logical_and(real, ops.not_equal(segments, previous))
    return ops.stack([ops.sum(ops.cast(real, "int32")), ops.cast(ops.size(segments), "int32"),
                      ops.sum(ops.cast(starts, "int32"))])


def fill_empty_rows(x, weight):
    """Token batches: the inputs of each row that holds no sequence (all its weights 0: the
    rows that fill a last evaluation batch, a replica's share of one) replaced by the
    batch's first real row. Their weight keeps them out of loss, metrics and gradients; the
    model never sees an empty row, on which a Keras model that masks padding and averages
    (``Embedding(mask_zero=True)``, ``GlobalAveragePooling1D``) divides 0 by 0, a NaN that
    a zero weight cannot cancel in the backward pass. One select per input; shapes kept."""
    rows = ops.shape(weight)[0]
    real = ops.any(ops.greater(ops.reshape(weight, (rows, -1)), 0), axis=1)
    first = ops.argmax(ops.cast(real, "int32"))  # 0 when none is real

    def fill(t):
        if len(t.shape) == 0:
            return t
        keep = ops.reshape(real, (rows,) + (1,) * (len(t.shape) - 1))
        # A gather, not t[first]: TF's XLA takes a strided slice's start as a compile-time
        # constant, so that recompiled the step for every batch (30x slower packed rows).
        return ops.where(keep, t, ops.take(t, ops.expand_dims(first, 0), axis=0))

    return tree.map_structure(fill, x)


def sparse_accuracy(labels, outputs):
    """1.0 where the arg-max of the outputs (logits or probabilities) equals the label."""
    labels = ops.reshape(ops.cast(labels, "int32"), (-1,))  # [B] or [B, 1]
    return ops.cast(ops.equal(ops.cast(ops.argmax(outputs, axis=-1), "int32"), labels),
                    "float32")
