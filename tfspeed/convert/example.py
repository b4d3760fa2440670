"""``tf.train.Example`` records without TensorFlow: the same bytes, built with ``protobuf`` alone.

A process that writes shards must not import TensorFlow: that costs seconds and memory per
spawned worker, and made conversion slower with more workers. The messages are declared here
from TF's ``tensorflow/core/example/{feature,example}.proto`` (proto3: float and int64 lists
packed), in a private descriptor pool so they never clash with TF's own classes when both are
loaded. ``SerializeToString(deterministic=True)`` then gives the bytes TF's ``tf.train.Example``
gives (tests compare them on every feature kind).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from tfspeed.data.schema import Feature

_F = descriptor_pb2.FieldDescriptorProto


def _file() -> descriptor_pb2.FileDescriptorProto:
    """feature.proto and example.proto as one file descriptor (field numbers as in TF)."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="tfspeed/convert/example.proto", package="tensorflow", syntax="proto3"
    )

    def message(name: str, *fields: tuple) -> descriptor_pb2.DescriptorProto:
        m = proto.message_type.add(name=name)
        for field_name, number, kind, label, type_name, oneof in fields:
            f = m.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                f.type_name = type_name
            if oneof is not None:
                f.oneof_index = oneof
        return m

    repeated, optional = _F.LABEL_REPEATED, _F.LABEL_OPTIONAL
    message("BytesList", ("value", 1, _F.TYPE_BYTES, repeated, None, None))
    message("FloatList", ("value", 1, _F.TYPE_FLOAT, repeated, None, None))  # packed (proto3)
    message("Int64List", ("value", 1, _F.TYPE_INT64, repeated, None, None))  # packed (proto3)
    feature = message(
        "Feature",
        ("bytes_list", 1, _F.TYPE_MESSAGE, optional, ".tensorflow.BytesList", 0),
        ("float_list", 2, _F.TYPE_MESSAGE, optional, ".tensorflow.FloatList", 0),
        ("int64_list", 3, _F.TYPE_MESSAGE, optional, ".tensorflow.Int64List", 0),
    )
    feature.oneof_decl.add(name="kind")
    features = message(
        "Features",
        ("feature", 1, _F.TYPE_MESSAGE, repeated, ".tensorflow.Features.FeatureEntry", None),
    )
    entry = features.nested_type.add(name="FeatureEntry")  # how protoc spells map<string, Feature>
    entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=optional)
    entry.field.add(
        name="value",
        number=2,
        type=_F.TYPE_MESSAGE,
        label=optional,
        type_name=".tensorflow.Feature",
    )
    entry.options.map_entry = True
    message("Example", ("features", 1, _F.TYPE_MESSAGE, optional, ".tensorflow.Features", None))
    return proto


_POOL = descriptor_pool.DescriptorPool()
_POOL.Add(_file())
Example = message_factory.GetMessageClass(_POOL.FindMessageTypeByName("tensorflow.Example"))


def serialize(features: Mapping[str, Feature], values: Mapping[str, Any]) -> bytes:
    """One record as a serialized ``tf.train.Example``, byte-identical to TF's.

    Args:
      features: the schema's features, by name.
      values: feature name -> value: bytes (or an object with ``__bytes__``) for an encoded
        image, an array-like of the feature's shape otherwise.

    Returns:
      The serialized message. Raises ValueError if a value's shape is not the feature's.
    """
    example = Example()
    feature_map = example.features.feature
    for name, value in values.items():
        fill(feature_map[name], features[name], value)
    # deterministic: map order otherwise follows the process's string hash seed, and the
    # same conversion must give byte-identical shards in every process.
    return example.SerializeToString(deterministic=True)


def fill(proto, feature: Feature, value: Any) -> None:
    """Sets the ``Feature`` message ``proto`` to ``value`` encoded as ``feature`` says."""
    if feature.is_image:
        proto.bytes_list.value.append(bytes(value))
        return
    array = np.asarray(value, dtype=feature.dtype)
    if feature.encoding == "tokens":  # any length
        if array.ndim != 1:
            raise ValueError(f"feature {feature.name!r}: token ids of shape {array.shape}, not 1-D")
        proto.int64_list.value.extend(array.tolist())
        return
    if array.shape != tuple(feature.shape):
        raise ValueError(
            f"feature {feature.name!r}: value of shape {array.shape}, schema says {feature.shape}"
        )
    if feature.encoding == "raw":
        proto.bytes_list.value.append(array.astype(array.dtype.newbyteorder("<")).tobytes())
    elif feature.encoding == "float":
        proto.float_list.value.extend(array.ravel().tolist())
    else:
        proto.int64_list.value.extend(array.ravel().tolist())
