"""tfspeed.data: the read side. Builds fast tf.data pipelines from converted TFRecord shards.

    import tfspeed.data
    ds = tfspeed.data.build("data/digits", "train", batch_size=128, training=True)

The converter that writes the shards is ``tfspeed.convert``; the format both share is
``tfspeed.data.schema`` (and ``tfspeed.data.integrity``, the TFRecord framing;
``tfspeed.data.source_files``, what a folder of source files looks like).
"""

from __future__ import annotations

import importlib

# Imported on first use (PEP 562): `import tfspeed.data.schema` (the converter's workers do)
# must not import the pipeline, and with it TensorFlow.
_LAZY = {
    "DataConfig": ("tfspeed.config", "DataConfig"),
    "build": ("tfspeed.data.pipeline", "build"),
    "build_from_config": ("tfspeed.data.pipeline", "build_from_config"),
    "Schema": ("tfspeed.data.schema", "Schema"),
    "read_schema": ("tfspeed.data.schema", "read"),
    "scaling_layer": ("tfspeed.data.images", "scaling_layer"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = _LAZY[name]
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
