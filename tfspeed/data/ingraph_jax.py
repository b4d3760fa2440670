"""The training split held on the device for the JAX engine: ``ingraph``'s in-step input,
with the batch of micro-step s gathered inside the compiled step (no tf.data per step).

Epoch e is a permutation of the records drawn from (seed, e) by a Feistel network over
the record indices (cycle-walking into [0, n)): the record at any position of the endless
stream is computed on its own, in O(1), so a batch that spans two epochs, a resumed run and
every device agree without a permutation table. (TensorFlow's ``RandomIndexShuffle`` plays
this part on TensorFlow; the two orders differ, each seeded.)
"""

from __future__ import annotations

import numpy as np

_ROUNDS = 4
_MIX = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


class InStepArrays:
    """The split's arrays on the devices; ``batch(step)`` inside the compiled step.

    Args:
      inputs: decoded inputs, one row per record (uint8 images or float features), or a dict
        of them (named inputs).
      labels: int32 labels.
      global_batch_size: examples per micro-step.
      seed: the data seed.
      shuffle: a new permutation every epoch (else the stored order every epoch).
      devices: the engine's devices: the arrays are replicated on each (None: the first).
    """

    in_step = True  # read by the trainer, checkpoints and diagnose (see ingraph.is_in_step)

    def __init__(self, inputs, labels: np.ndarray, *, global_batch_size: int, seed: int = 0,
                 shuffle: bool = True, devices=None):
        import jax

        devices = list(devices or jax.devices()[:1])
        mesh = jax.sharding.Mesh(np.asarray(devices), ("batch",))
        replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self.num_records = len(labels)
        self.global_batch_size = global_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.arrays = jax.device_put({"inputs": inputs, "labels": np.asarray(labels, np.int32)},
                                     replicated)

    def batch(self, arrays, step):
        """``(x, y)`` of micro-step ``step`` (traced): rows ``step * B ... + B - 1`` of the
        endless stream of epochs."""
        import jax.numpy as jnp
        from keras import tree

        # int32 (JAX's default width): a run of up to 2^31 examples.
        positions = (step.astype(jnp.int32) * self.global_batch_size
                     + jnp.arange(self.global_batch_size, dtype=jnp.int32))
        rows = self.rows(positions)
        x = tree.map_structure(lambda a: jnp.take(a, rows, axis=0), arrays["inputs"])
        return x, jnp.take(arrays["labels"], rows, axis=0)

    def rows(self, positions):
        """The record at each position of the stream (traced, int32)."""
        import jax.numpy as jnp

        n = self.num_records
        epoch, offset = positions // n, positions % n
        if not self.shuffle:
            return offset.astype(jnp.int32)
        return feistel_permute(offset, epoch, n, self.seed).astype(jnp.int32)


def feistel_permute(index, epoch, n: int, seed: int):
    """A permutation of [0, n) for each (seed, epoch), applied to ``index`` (traced): a
    balanced Feistel network over the smallest even number of bits covering n, walked
    until the value falls inside [0, n) (a permutation of a superset, restricted)."""
    import jax
    import jax.numpy as jnp

    bits = max(2, int(n - 1).bit_length() + (int(n - 1).bit_length() % 2))
    half = bits // 2
    mask = (1 << half) - 1
    keys = [(seed * 0x632BE5AB + r * 0x3C6EF372) & 0xFFFFFFFF for r in range(_ROUNDS)]
    epoch = epoch.astype(jnp.uint32)

    def round_fn(value, key, mix):
        v = (value.astype(jnp.uint32) ^ jnp.uint32(key)) * jnp.uint32(mix)
        v = v ^ (epoch * jnp.uint32(0x9E3779B9))
        v = (v ^ (v >> 15)) * jnp.uint32(0x2C1B3C6D)
        return (v ^ (v >> 12)) & jnp.uint32(mask)

    def encrypt(value):
        left, right = (value >> half) & mask, value & mask
        for key, mix in zip(keys, _MIX, strict=True):
            left, right = right, left ^ round_fn(right, key, mix)
        return (left << half) | right

    def walk(carry):  # values still outside [0, n) take another round of the network
        value, outside = carry
        value = jnp.where(outside, encrypt(value), value)
        return value, value >= n

    first = encrypt(index.astype(jnp.uint32))
    value, _ = jax.lax.while_loop(lambda c: jnp.any(c[1]), walk, (first, first >= n))
    return value
