"""api/process_memory.py: the resident memory and its parts in the start-up log."""

from __future__ import annotations

from api.process_memory import GIB, describe_rss, rss_parts

STATUS = """Name:\tpython
VmHWM:\t 5000000 kB
VmRSS:\t 3145728 kB
RssAnon:\t 2097152 kB
RssFile:\t 1048576 kB
RssShmem:\t       0 kB
"""


def test_the_parts_are_read_in_bytes(tmp_path):
    path = tmp_path / "status"
    path.write_text(STATUS)
    assert rss_parts(str(path)) == {"rss": 3 * GIB, "anon": 2 * GIB, "file": GIB, "shmem": 0}, \
        "kB as the kernel writes them, VmHWM (the peak) not taken for VmRSS"
    assert rss_parts(str(tmp_path / "missing")) is None


def test_the_line_splits_anonymous_memory_into_weights_kv_and_the_rest():
    parts = {"rss": 3 * GIB, "anon": 2 * GIB, "file": GIB, "shmem": 0}
    line = describe_rss(GIB // 2, GIB // 4, parts)
    # 2 GiB anonymous - 0.5 weights - 0.25 KV = 1.25 the rest
    assert line == ("RSS 3.00 GiB: anonymous 2.00 (weights 0.50 + KV cache 0.25 + the rest 1.25), "
                    "mapped files 1.00, shared 0.00"), line


def test_this_process_has_a_resident_set():
    parts = rss_parts()
    assert parts is None or parts["rss"] > 0 and parts["anon"] + parts["file"] <= parts["rss"] + 4096
