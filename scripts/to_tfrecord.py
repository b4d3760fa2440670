#!/usr/bin/env python
"""Converts a dataset into tfspeed TFRecord shards: see `python scripts/to_tfrecord.py --help`.

python scripts/to_tfrecord.py --source=digits --output=data/digits
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, _REPO)

# The converter does no TensorFlow math; these only silence TF's import-time log lines
# (oneDNN notice) so that stderr holds warnings and errors. The caller's settings win.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

from tfspeed.data.convert import run  # noqa: E402

if __name__ == "__main__":
    run()
