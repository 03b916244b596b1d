"""The server process's resident memory and its parts, for the start-up log.

`rss_parts()` reads /proc/self/status: `rss` (VmRSS) is `anon` (RssAnon: the heap, XLA's
buffers, i.e. the weights and the KV cache on a CPU, compiled code, Python) plus `file`
(RssFile: mapped files' pages, e.g. a GGUF read through its memory map, and the shared
libraries) plus `shmem` (RssShmem). `describe_rss` says it in one line beside the bytes the
engine placed, so a start-up log shows where the memory went. Elsewhere than Linux: None.
"""

from __future__ import annotations

_FIELDS = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
GIB = 1 << 30


def rss_parts(status_path: str = "/proc/self/status") -> dict[str, int] | None:
    """{"rss", "anon", "file", "shmem"} in bytes, or None where /proc is not there."""
    parts: dict[str, int] = {}
    try:
        with open(status_path) as f:
            for line in f:
                words = line.split()
                if words and words[0] in _FIELDS and len(words) >= 2:
                    parts[_FIELDS[words[0]]] = int(words[1]) * 1024  # kB
    except (OSError, ValueError):
        return None
    return parts if "rss" in parts else None


def describe_rss(weights_bytes: int, kv_bytes: int, parts: dict[str, int] | None = None) -> str:
    """"RSS 1.52 GiB: anonymous 1.31 (weights 0.60 + KV cache 0.12 + the rest 0.59), mapped
    files 0.21"; the rest is the runtime, compiled steps, Python and the tokenizer."""
    parts = rss_parts() if parts is None else parts
    if parts is None:
        return "RSS unknown (no /proc/self/status)"
    anon = parts.get("anon", parts["rss"])
    rest = anon - weights_bytes - kv_bytes
    return (f"RSS {parts['rss'] / GIB:.2f} GiB: anonymous {anon / GIB:.2f} (weights {weights_bytes / GIB:.2f} + "
            f"KV cache {kv_bytes / GIB:.2f} + the rest {rest / GIB:.2f}), mapped files "
            f"{parts.get('file', 0) / GIB:.2f}, shared {parts.get('shmem', 0) / GIB:.2f}")
