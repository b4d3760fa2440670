"""tfspeed.data: convert datasets to TFRecord shards and build fast tf.data pipelines from them.

    import tfspeed.data
    ds = tfspeed.data.build("data/digits", "train", batch_size=128, training=True)
"""

from tfspeed.config import DataConfig
from tfspeed.data.pipeline import build, build_from_config
from tfspeed.data.schema import Schema
from tfspeed.data.schema import read as read_schema

__all__ = ["DataConfig", "Schema", "build", "build_from_config", "read_schema"]
