"""Runtime: the strategy, precision policy and XLA choice, resolved once from RuntimeConfig."""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from tfspeed.config import RuntimeConfig


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What the step runs on, and why each choice was made.

    Attributes:
      strategy: the ``tf.distribute`` strategy; build models and optimizers in its scope.
      precision: the Keras dtype policy name in force.
      xla: whether the per-replica step is XLA-compiled.
      reasons: for each choice, a sentence saying why (recorded in report.json).
    """

    strategy: tf.distribute.Strategy
    precision: str
    xla: bool
    reasons: dict[str, str]

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    def to_json(self) -> dict:
        return {
            "strategy": type(self.strategy).__name__,
            "num_replicas": self.num_replicas,
            "precision": self.precision,
            "xla": self.xla,
            "reasons": dict(self.reasons),
        }


def setup(config: RuntimeConfig) -> Runtime:
    """Resolves ``config`` against this machine and sets the global precision policy."""
    keras.mixed_precision.set_global_policy("float32")
    return Runtime(
        strategy=tf.distribute.get_strategy(),
        precision="float32",
        xla=False,
        reasons={
            "strategy": "default strategy: one device",
            "precision": "float32",
            "xla": "off",
        },
    )
