"""TensorFlow's host allocator: tfspeed gives it a BFC pool where it would use malloc, and
leaves it alone where oneDNN's pool is on or the user chose."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO

from tfspeed.runtime import hostmem

OLD_CPU = frozenset({"sse4_2", "avx", "avx2", "fma", "avx512f"})  # e.g. Skylake-SP, Zen 3
NEW_CPU = OLD_CPU | {"avx512_vnni", "avx512_bf16"}  # e.g. Sapphire Rapids, Zen 4
BFC = {"TF_CPU_ALLOCATOR_USE_BFC": "1", "TF_CPU_BFC_MEM_LIMIT_IN_MB": "24000"}


@pytest.mark.parametrize("environ, flags, expected", [
    ({}, OLD_CPU, BFC),  # TensorFlow would use malloc
    ({}, NEW_CPU, {}),  # oneDNN on by default: its pool already
    ({}, OLD_CPU | {"avx_vnni"}, {}),
    ({}, OLD_CPU | {"amx_tile"}, {}),
    ({"TF_ENABLE_ONEDNN_OPTS": "0"}, NEW_CPU, BFC),  # oneDNN turned off: malloc again
    ({"TF_ENABLE_ONEDNN_OPTS": "False"}, NEW_CPU, BFC),
    ({"TF_ENABLE_ONEDNN_OPTS": "1"}, OLD_CPU, {}),
    ({"TF_ENABLE_ONEDNN_OPTS": "maybe"}, OLD_CPU, BFC),  # TensorFlow ignores it too
    ({"TF_CPU_ALLOCATOR_USE_BFC": "0"}, OLD_CPU, {}),  # the user's choice wins
    ({"TF_CPU_BFC_MEM_LIMIT_IN_MB": "512"}, OLD_CPU, {"TF_CPU_ALLOCATOR_USE_BFC": "1"}),
])
def test_settings_follow_tensorflows_onednn_policy(environ, flags, expected):
    assert hostmem.settings(environ, flags, total_mb=24000) == expected


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                       "flags\t\t: fpu sse4_2 avx2 avx512_vnni\nbugs\t\t: sysret_ss_attrs\n")
    assert hostmem.cpu_flags(str(cpuinfo)) == {"fpu", "sse4_2", "avx2", "avx512_vnni"}
    assert hostmem.cpu_flags(str(tmp_path / "missing")) == frozenset()


_PROBE = """
import json, sys
sys.path.insert(0, {repo!r})
if {tensor_first}:
    import tensorflow as tf
    tf.zeros([3])  # TensorFlow makes its CPU allocator here
import tfspeed
from tfspeed.runtime import hostmem
print(json.dumps({{"allocator": hostmem.describe(), "advice": hostmem.advice()}}))
"""


def _probe(tensor_first: bool = False, **env) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPU_")}
    environ.update(TF_CPP_MIN_LOG_LEVEL="3", TF_ENABLE_ONEDNN_OPTS="0", **env)
    code = _PROBE.format(repo=str(REPO), tensor_first=tensor_first)
    return subprocess.Popen([sys.executable, "-c", code], env=environ, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def test_real_processes_get_the_pool_unless_the_user_or_import_order_says_otherwise():
    # oneDNN off, as on a CPU without VNNI/AMX: TensorFlow alone would use malloc.
    procs = {"default": _probe(),
             "user_keeps_malloc": _probe(TF_CPU_ALLOCATOR_USE_BFC="0"),
             "tensor_before_tfspeed": _probe(tensor_first=True)}
    results = {name: _result(proc) for name, proc in procs.items()}
    assert results["default"] == {"allocator": "pool", "advice": None}
    assert results["user_keeps_malloc"] == {"allocator": "malloc", "advice": None}
    late = results["tensor_before_tfspeed"]
    assert late["allocator"] == "malloc"
    assert "import tfspeed before creating any tensor" in late["advice"]
    assert "TF_CPU_ALLOCATOR_USE_BFC=1" in late["advice"]
