"""Images in a prompt, on the engine's side: where they sit, how they are named, when they are
encoded, and what the step receives. No jax here.

The API lays an image into the prompt as its placeholder tokens (Gemma 3: `<start_of_image>`,
then `tokens_per_image` soft tokens, then `<end_of_image>`) and hands the job one `ImageSpan`
per image: where its soft tokens start in the prompt, how many there are, the digest of its
preprocessed pixels, and the pixels. From there:

- **Naming (the prefix cache).** A block's name hashes its token ids, and every image's soft
  tokens are the same id, so two images behind the same text would share blocks. `hash_ids`
  gives the ids the names are computed from: each soft token replaced by a negative number
  drawn from its image's digest (real ids are never negative), so the same image and text hit
  and another image behind the same text misses.
- **Chunking.** A bidirectional image's tokens attend to each other both ways, so all of its
  tokens that are still to compute go in one forward: `chunk_end` moves a chunk's end off the
  inside of such an image (back to its start, or on to its end; the engine keeps the chunk size
  at least one image). A causal span (`ImageSpan.bidirectional` False: Idefics3 / SmolVLM's
  tiles) may be cut like text.
- **Encoding.** Before a step's host batch is built, `attach_embeddings` gives each chunk's
  images their soft-token embeddings: from the `EncoderCache` (by digest) or from one call
  of the encoder over the step's missing images; counted as encoder runs and cache hits.
- **The step's columns** (`image_columns`): per new token, the embedding that replaces it
  (bool mask + f32 rows), and `attend_until`, the furthest key position it may see: a
  bidirectional image's last position for its tokens, the token's own position otherwise.
- **M-RoPE positions** (Qwen2.5-VL, `ImageSpan.grid` set): every token of such a job, in a
  prompt chunk or decoding, takes 3-D rotary positions that are a function of its position and
  the job's images (`mrope_positions`); the scheduler hands each row of the job its images
  (`RowPlan.rope_images`) and the step gets an i32[N, 3] column (`rope_columns`). The KV cache
  and the block names stay by token index, so a prefix hit reuses K/V computed at the same
  3-D positions (the same ids and images give the same positions).

How a family lays its images out (one span per image, or one per tile) is
`ferrox_jax/image_layout.py`'s.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from models.image_input import ImageError, ImageLimits, decode_image, resize_normalize


@dataclasses.dataclass(frozen=True)
class ImageSpan:
    """One image of a prompt: its soft tokens are prompt positions `start .. start + length - 1`."""

    start: int
    length: int
    digest: bytes  # sha256 of the preprocessed pixels (the encoder cache's and the block names' key)
    pixels: Any = dataclasses.field(default=None, compare=False, repr=False)  # f32[C, S, S]
    embeds: Any = dataclasses.field(default=None, compare=False, repr=False)  # f32[length, D] once encoded
    # Its tokens attend to each other both ways (Gemma 3), or causally as text does (Idefics3 / SmolVLM).
    bidirectional: bool = True
    # M-RoPE (Qwen2.5-VL): the image's grid of tokens (t, rows, columns), t * rows * columns =
    # length; its tokens take 3-D positions on it (`mrope_positions`). None: plain positions.
    grid: tuple[int, int, int] | None = None

    @property
    def stop(self) -> int:
        return self.start + self.length


def preprocess(blobs: Sequence[bytes], size: int, limits: ImageLimits) -> list[tuple[np.ndarray, bytes]]:
    """(pixels f32[3, size, size], digest) per image file: checked and decoded
    (`models/image_input.py`), resized and normalised; the digest is the sha256 of the size and
    the pixels. Raises ImageError naming the image (1-based) and what is wrong."""
    out = []
    for i, data in enumerate(blobs):
        try:
            pixels = resize_normalize(decode_image(data, limits), size)
        except ImageError as e:
            raise ImageError(f"image {i + 1}: {e}") from None
        out.append((pixels, hashlib.sha256(b"%d|" % size + pixels.tobytes()).digest()))
    return out


def expand_markers(text: str, vision: Any, tokenizer: Any, count: int) -> str:
    """A rendered prompt with each of its `count` begin-of-image markers expanded as HF's Gemma 3
    processor does: "\n\n", the marker, the image's soft tokens, the end marker, "\n\n".
    Raises ValueError when the markers are not one per image or the tokenizer lacks them."""
    if not count:
        return text
    boi, eoi, soft = (tokenizer.id_to_token(i) for i in (vision.boi_token_id, vision.eoi_token_id,
                                                           vision.image_token_id))
    if not (boi and eoi and soft):
        raise ValueError("this model's tokenizer lacks its image marker tokens; it cannot take images")
    return replace_markers(text, boi, [f"\n\n{boi}{soft * vision.tokens_per_image}{eoi}\n\n"] * count)


def replace_markers(text: str, marker: str, texts: Sequence[str]) -> str:
    """`text` with its image markers replaced, in order, by `texts` (one per image). Raises
    ValueError when the prompt's markers are not one per image."""
    pieces = text.split(marker)
    if len(pieces) - 1 != len(texts):
        raise ValueError(f"the prompt has {len(pieces) - 1} image markers ({marker}) for {len(texts)} images; "
                         "put one where each image goes")
    out = [pieces[0]]
    for replacement, piece in zip(texts, pieces[1:]):
        out += [replacement, piece]
    return "".join(out)


def find_spans(ids: Sequence[int], vision: Any, pictures: Sequence[tuple[Any, bytes]]) -> tuple[ImageSpan, ...]:
    """Each picture's (pixels, digest) at its run of soft tokens in the tokenized prompt, in order.
    Raises ValueError when the runs are not one whole run per picture."""
    if not pictures:
        return ()
    soft, length = vision.image_token_id, vision.tokens_per_image
    starts = [i for i, t in enumerate(ids) if t == soft and (i == 0 or ids[i - 1] != soft)]
    runs = [(s, next((j for j in range(s, len(ids)) if ids[j] != soft), len(ids)) - s) for s in starts]
    if len(runs) != len(pictures) or any(n != length for _, n in runs):
        raise ValueError("the prompt's image placeholders do not match its images (an image token in the "
                         "text?); give images as image inputs only")
    return tuple(ImageSpan(start, length, digest, pixels) for (start, _), (pixels, digest) in zip(runs, pictures))


def image_file_bytes(image: Any) -> bytes:
    """File bytes of an image given as bytes, a PIL image or a uint8 [H, W, 3] array (as PNG: lossless)."""
    if isinstance(image, (bytes, bytearray)):
        return bytes(image)
    import io

    from PIL import Image

    if isinstance(image, np.ndarray):
        image = Image.fromarray(np.asarray(image, np.uint8))
    if not isinstance(image, Image.Image):
        raise ValueError(f"an image is file bytes, a PIL image or a uint8 array; got {type(image).__name__}")
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def check_spans(images: Sequence[ImageSpan], prompt_len: int) -> None:
    """Raises ValueError unless the spans are in order, apart, and inside the prompt."""
    end = 0
    for image in images:
        if image.length < 1 or image.start < end or image.stop > prompt_len:
            raise ValueError(f"image spans must be in order, apart and inside the {prompt_len}-token prompt; "
                             f"got start {image.start}, length {image.length}")
        if len(image.digest) != 32:
            raise ValueError("an image's digest must be 32 bytes (sha256)")
        if image.grid is not None and (len(image.grid) != 3 or math.prod(image.grid) != image.length):
            raise ValueError(f"an image's grid (t, rows, cols) must hold its {image.length} tokens; got {image.grid}")
        end = image.stop


def hash_ids(token_ids: Sequence[int], images: Sequence[ImageSpan]) -> Sequence[int]:
    """The ids block names are computed from: `token_ids` with each image's soft tokens
    replaced by negative numbers from its digest (eight 31-bit words, cycled)."""
    if not images:
        return token_ids
    ids = list(token_ids)
    for image in images:
        words = [-1 - (int.from_bytes(image.digest[4 * i:4 * i + 4], "little") & 0x7FFFFFFF) for i in range(8)]
        for k in range(image.start, min(image.stop, len(ids))):
            ids[k] = words[(k - image.start) % 8] ^ ((k - image.start) // 8 << 3)
    return ids


def mrope_positions(positions: np.ndarray, images: Sequence[ImageSpan]) -> np.ndarray:
    """i32[n, 3] M-RoPE positions (temporal, height, width) of token positions i32[n] of a
    prompt (or its output) whose images, all of them in order, are `images`: a text token's
    three positions are its position plus the shift of the images before it; an image's
    token k sits at s + (k // (rows cols), k // cols % rows, k % cols), s its first token's
    text position; an image moves what follows by max(rows, columns) - length (HF's
    `get_rope_index`: the text after an image continues from its largest position + 1)."""
    positions = np.asarray(positions, np.int64)
    out = np.repeat(positions[:, None], 3, axis=1)
    shift = 0
    for image in images:
        if image.grid is None:
            continue
        _, rows, cols = image.grid
        inside = (positions >= image.start) & (positions < image.stop)
        k = positions[inside] - image.start
        out[inside] = image.start + shift + np.stack([k // (rows * cols), k // cols % rows, k % cols], axis=1)
        moved = max(rows, cols) - image.length
        out[positions >= image.stop] += moved
        shift += moved
    return out.astype(np.int32)


def chunk_end(images: Sequence[ImageSpan], start: int, end: int, cap: int) -> int:
    """A chunk over [start, end) moved so no image is cut: an end inside an image goes back
    to the image's start, or (when the chunk starts inside or at it) on to its end, at most
    `start + cap`."""
    for image in images:
        if image.bidirectional and image.start < end < image.stop:
            return image.start if image.start > start else min(image.stop, start + cap)
    return end


def overlapping(images: Sequence[ImageSpan], start: int, end: int) -> tuple[ImageSpan, ...]:
    """The images with a soft token in positions [start, end)."""
    return tuple(image for image in images if image.start < end and image.stop > start)


class EncoderCache:
    """Soft-token embeddings by image digest, least recently used dropped past `max_bytes`."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: collections.OrderedDict[bytes, np.ndarray] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, digest: bytes) -> np.ndarray | None:
        embeds = self._entries.get(digest)
        if embeds is not None:
            self._entries.move_to_end(digest)
        return embeds

    def put(self, digest: bytes, embeds: np.ndarray) -> None:
        if digest in self._entries or embeds.nbytes > self.max_bytes:
            return
        self._entries[digest] = embeds
        self.num_bytes += embeds.nbytes
        while self.num_bytes > self.max_bytes:
            _, dropped = self._entries.popitem(last=False)
            self.num_bytes -= dropped.nbytes


@dataclasses.dataclass
class EncoderCounters:
    """Image counters the stats report (ours, beside the contract's)."""

    encoder_runs: int = 0  # images (a tiled model's tiles) the vision encoder computed
    encoder_cache_hits: int = 0  # images (tiles) whose embeddings came from the encoder cache
    image_tokens: int = 0  # image soft tokens computed by forwards (prompt-cache hits excluded)


def attach_embeddings(rows: Sequence, encode: Callable[[np.ndarray], np.ndarray], cache: EncoderCache,
                      counters: EncoderCounters) -> list:
    """The chunk rows (`RowPlan`s) with every image they hold given its embeddings: from the
    cache, or from one `encode(pixels f32[B, C, S, S]) -> f32[B, T, D]` call over the rest."""
    missing: dict[bytes, ImageSpan] = {}
    for row in rows:
        for image in row.images:
            if image.embeds is None and cache.get(image.digest) is None:
                missing.setdefault(image.digest, image)
    if missing:
        encoded = encode(_batch([image.pixels for image in missing.values()]))
        for image, embeds in zip(missing.values(), encoded):
            if embeds.shape[0] != image.length:
                raise ValueError(f"the encoder gave {embeds.shape[0]} soft tokens for an image of {image.length}")
            cache.put(image.digest, np.asarray(embeds, np.float32))
        counters.encoder_runs += len(missing)
    out = []
    for row in rows:
        if not row.images:
            out.append(row)
            continue
        images = []
        for image in row.images:
            embeds = image.embeds if image.embeds is not None else cache.get(image.digest)
            if embeds is None:  # the cache dropped it between put and here (smaller than one step's images)
                embeds = np.asarray(encode(_batch([image.pixels]))[0], np.float32)
                counters.encoder_runs += 1
            elif image.digest not in missing:
                counters.encoder_cache_hits += 1
            images.append(dataclasses.replace(image, embeds=embeds))
            lo, hi = max(image.start, row.start_pos), min(image.stop, row.start_pos + len(row.token_ids))
            counters.image_tokens += max(0, hi - lo)
        out.append(dataclasses.replace(row, images=tuple(images)))
    return out


def _batch(pixels: list) -> Any:
    """What `encode` takes: same-size images stacked (f32[B, C, S, S]); a family whose images
    differ in size (Qwen2.5-VL's patch grids) takes the list."""
    return np.stack(pixels) if isinstance(pixels[0], np.ndarray) else pixels


class ImageStage:
    """The owner thread's image work: the encoder cache and its counters. `attach(plan)` gives
    the plan's chunks their images' embeddings before the host batch is built (a plan without
    images passes through)."""

    def __init__(self, encode: Callable[[np.ndarray], np.ndarray], cache_bytes: int = 512 * 2**20) -> None:
        self._encode = encode
        self.cache = EncoderCache(cache_bytes)
        self._counters = EncoderCounters()

    def attach(self, plan):
        if not any(row.images for row in plan.chunks):
            return plan
        return dataclasses.replace(plan, chunks=tuple(attach_embeddings(plan.chunks, self._encode, self.cache,
                                                                        self._counters)))

    @property
    def counters(self) -> dict[str, int]:
        """The `BatcherStats` fields this stage counts."""
        return dict(vars(self._counters))  # read every tick: asdict deep-copies


def image_columns(rows: Sequence, row_starts: np.ndarray, num_tokens: int, width: int):
    """(embeds f32[N, D], mask bool[N], attend_until i32[N]) of a step's rows, or None when no
    row holds an image. `attend_until` is each token's own position except an image's."""
    if not any(row.images for row in rows):
        return None
    embeds = np.zeros((num_tokens, width), np.float32)
    mask = np.zeros(num_tokens, bool)
    until = np.zeros(num_tokens, np.int32)
    for i, row in enumerate(rows):
        lo = int(row_starts[i])
        count = len(row.token_ids)
        until[lo:lo + count] = np.arange(row.start_pos, row.start_pos + count)
        for image in row.images:
            first, last = max(image.start, row.start_pos), min(image.stop, row.start_pos + count)
            if first >= last:
                continue
            at = lo + first - row.start_pos
            embeds[at:at + last - first] = image.embeds[first - image.start:last - image.start]
            mask[at:at + last - first] = True
            if image.bidirectional:
                until[at:at + last - first] = image.stop - 1
    return embeds, mask, until


def rope_columns(rows: Sequence, row_starts: np.ndarray, positions: np.ndarray) -> np.ndarray | None:
    """i32[N, 3] M-RoPE positions of a step's tokens (at `positions` i32[N]: `mrope_positions` of
    each row's `rope_images`; a row without them: its position three times), or None when no row
    has any (a text-only step: the forward repeats each position). A row past its images (a
    decoding row) is its positions plus the images' shift, with no per-token work."""
    if not any(row.rope_images for row in rows):
        return None
    shifts = np.zeros(len(positions), np.int32)
    inside = []
    for i, row in enumerate(rows):
        images = row.rope_images
        if images and row.start_pos < images[-1].stop:
            inside.append(i)
        elif images:
            shifts[row_starts[i]:row_starts[i + 1]] = sum(max(im.grid[1:]) - im.length for im in images
                                                          if im.grid is not None)
    out = np.repeat((positions + shifts)[:, None], 3, axis=1)
    for i in inside:
        lo, hi = row_starts[i], row_starts[i + 1]
        out[lo:hi] = mrope_positions(positions[lo:hi], rows[i].rope_images)
    return out


def rope_images(images: Sequence[ImageSpan]) -> tuple[ImageSpan, ...]:
    """A job's images as its rows carry them for M-RoPE (`RowPlan.rope_images`): all of them
    when they have grids, () otherwise (no column, no cost)."""
    return tuple(images) if any(image.grid is not None for image in images) else ()
