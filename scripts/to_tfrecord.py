#!/usr/bin/env python
"""Converts a dataset into tfspeed TFRecord shards: see `python scripts/to_tfrecord.py --help`.

python scripts/to_tfrecord.py --source=digits --output=data/digits
"""

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, _REPO)

from tfspeed.convert.cli import convert_main  # noqa: E402

if __name__ == "__main__":
    convert_main()
