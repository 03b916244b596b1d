"""Images in a request, on every wire: image parts to checked pixels, and the prompt's placeholders to
the engine's `ImageSpan`s.

Each wire names an image its own way; all of them become one `{"type": "image"}` item in the chat
template's message content (what the vision-language templates expect) and one file's bytes:

    OpenAI chat      {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}
    Responses        {"type": "input_image", "image_url": "data:image/png;base64,..."}
    Anthropic        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "..."}}

    OpenAI chat / Responses with an `http(s)` URL instead of a data: URL, Anthropic
                     {"type": "image", "source": {"type": "url", "url": "https://..."}}

Inline images (data: URLs, base64) are always taken. An `http(s)` URL is fetched only from the hosts
the operator lists in `--allowed-media-domains` (none by default: a request must not make the server
reach other hosts unasked), under the rules `api/image_fetch.py` sets out (resolve and check every
address, no redirects to another host, the byte limit while streaming, one time limit, a bounded
number of fetches at once, off the loop's critical path); a URL that may not be fetched is a 400 naming
the setting. `part_bytes` only reads the part: a URL becomes a `RemoteImage`, fetched by `prepare`
(all of one request's at once) after the image count was checked. A part's bytes are checked and decoded in the CPU pool
(`models/image_input.py`: limits from the header first, so a decompression bomb costs nothing),
resized and normalised as the model's HF image processor does, and named by the sha256 of the
pixels (the encoder cache's and the prefix cache's key). Every refusal is a 400 naming the part
and the limit: too many images, too many bytes or pixels, not an image, truncated, an image for a
model that takes none.

The rendered prompt holds one image marker per image (Gemma 3: `<start_of_image>`; Idefics3 /
SmolVLM: `<image>`; Qwen2.5-VL: `<|image_pad|>`); `expand` replaces each with what the model's HF
processor puts there (Gemma 3: "\\n\\n", the marker, the image's soft tokens, the end marker,
"\\n\\n"; Idefics3: each tile's markers and tokens, then the global view's; Qwen2.5-VL: the marker
once per image token of its grid), and after tokenizing `spans` finds each image's (or tile's) run
of tokens, so `Job.images` says where every embedding goes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import re
from typing import TYPE_CHECKING, Any, NamedTuple

from api import image_fetch
from api.errors import APIError
from api.offload import run_cpu
from ferrox_jax.engine import ImageError, ImageLimits

if TYPE_CHECKING:
    from api.config import ServerConfig
    from ferrox_jax.engine import Engine
    from ferrox_jax.request import ImageSpan

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
_DATA_URL = re.compile(r"^data:(image/[\w.+-]+)?(;[\w-]+=[\w.-]+)*;base64,", re.IGNORECASE)


class RemoteImage(NamedTuple):
    """An image part naming an http(s) URL: `prepare` fetches it (api/image_fetch.py)."""

    url: str
    param: str


def is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def part_bytes(part: dict, param: str) -> bytes | RemoteImage:
    """The file bytes of one image part of any wire, or the URL to fetch them from (module docstring).
    Raises APIError 400."""
    kind = part.get("type")
    if kind == "image":  # Anthropic
        source = part.get("source")
        if isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str) \
                and image_fetch.is_remote(source["url"]):
            return RemoteImage(source["url"], param)
        if not isinstance(source, dict) or source.get("type") != "base64" or not isinstance(source.get("data"), str):
            raise APIError(400, 'an image block needs "source": {"type": "base64", "media_type": ..., "data": ...}',
                           param=param)
        return _base64(source["data"], param)
    url = part.get("image_url")
    if isinstance(url, dict):  # OpenAI chat: {"url": ..., "detail": ...}
        url = url.get("url")
    if not isinstance(url, str):
        raise APIError(400, f'an {kind} part needs an image URL (a "data:image/...;base64," URL)', param=param)
    match = _DATA_URL.match(url)
    if match is None:
        if image_fetch.is_remote(url):
            return RemoteImage(url, param)
        raise APIError(400, 'an image URL must be a "data:image/...;base64," URL or an http(s) URL', param=param)
    return _base64(url[match.end():], param)


def _base64(text: str, param: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, "the image's base64 data does not decode; send the file's bytes base64-encoded",
                       param=param) from None


def check_count(engine: Engine, count: int, config: ServerConfig, param: str) -> None:
    if count and not engine.takes_images:
        raise APIError(400, f"the model {engine.model_name!r} takes no images; send text only",
                       param=param, code="images_unsupported")
    if count > config.max_images:
        raise APIError(400, f"{count} images in one request; the limit is {config.max_images} (--max-images)",
                       param=param)


async def prepare(engine: Engine, blobs: list[bytes | RemoteImage], config: ServerConfig, param: str) -> list[Any]:
    """Each image's picture (`Engine.prepare_images`: pixels or tiles, sha256 digest), decoded and
    resized in the CPU pool; the URLs among `blobs` fetched first, concurrently (api/image_fetch.py)."""
    if not blobs:
        return []
    if any(isinstance(b, RemoteImage) for b in blobs):
        blobs = await fetch_all(blobs, config)
    limits = ImageLimits(max_bytes=config.max_image_bytes, max_pixels=config.max_image_pixels)
    try:
        return await run_cpu(engine.prepare_images, blobs, limits)
    except ImageError as e:
        raise APIError(400, str(e), param=param, code="invalid_image") from None


async def fetch_all(blobs: list[bytes | RemoteImage], config: ServerConfig) -> list[bytes]:
    """The bytes of every image, each URL fetched (concurrently: one request's URLs share its wait).
    The first refusal is the request's 400; the other fetches are cancelled with it."""
    rules = image_fetch.Rules(config.allowed_media_domains, config.max_image_bytes, config.media_fetch_timeout_s)

    async def one(blob: bytes | RemoteImage) -> bytes:
        return await image_fetch.fetch(blob.url, rules, blob.param) if isinstance(blob, RemoteImage) else blob

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(b)) for b in blobs]
    except ExceptionGroup as failed:  # the first refusal, as the route's own 400
        raise failed.exceptions[0] from None
    return [t.result() for t in tasks]


def expand(text: str, engine: Engine, pictures: list[Any], param: str) -> str:
    """The rendered prompt with each image marker expanded into its picture's tokens."""
    try:
        return engine.expand_images(text, list(pictures))
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None


def spans(ids: list[int], engine: Engine, pictures: list[tuple[Any, bytes]], param: str) -> tuple[ImageSpan, ...]:
    """Each image's run of soft tokens in the tokenized prompt, in order."""
    try:
        return engine.image_spans(ids, pictures)
    except ValueError as e:
        raise APIError(400, str(e), param=param) from None
