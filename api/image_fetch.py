"""Image URLs a request names, fetched from the hosts the operator allows and from nowhere else.

An image part may name an `http(s)` URL instead of carrying its bytes (api/images.py). The server
fetches it only when the URL's host is among `--allowed-media-domains` (FERROX_ALLOWED_MEDIA_DOMAINS,
`ServerConfig.allowed_media_domains`; vLLM's `--allowed-media-domains`, llama.cpp's server's remote
media): by default the list is empty and every such URL is a 400 naming the setting, because a
server that fetches what a request names can be made to reach hosts its clients cannot.

An entry is a host name (`images.example.com`, that host only), a domain with a leading dot
(`.example.com`: the domain and every host under it), an IP address (`127.0.0.1`) or a network
(`10.0.0.0/8`). The rules a fetch follows, each refusal a 400 that says what to do:

- only `http://` and `https://` URLs (https checks the host's certificate as usual);
- server-side request forgery: the host name is resolved first and every address it resolves to
  is checked; a loopback, private, link-local, multicast or otherwise non-global address is refused
  unless that address (or a network holding it) is listed itself. Listing a name is not enough to
  reach an internal address through it. The connection then goes to an address that was checked,
  not to a second lookup's answer (a name that resolves differently the second time gains nothing);
- redirects are followed only to the same host (at most `MAX_REDIRECTS`), each hop checked again;
  a redirect to another host is refused, whatever the list says (vLLM's
  `VLLM_MEDIA_URL_ALLOW_REDIRECTS=0` for other hosts);
- the body is read in chunks and cut off as soon as it passes the image byte limit
  (`--max-image-bytes`): a Content-Length above it is refused before any of the body is read;
- one total time limit (`ServerConfig.media_fetch_timeout_s`) covers waiting for a fetch slot, the
  lookup, connecting, every redirect and the body;
- at most `MAX_CONCURRENT_FETCHES` fetches run at once per event loop; the others wait (inside their
  time limit). A fetch is plain non-blocking socket I/O on the event loop (`asyncio` streams, HTTP/1.1
  parsed by h11, which Hypercorn already brings), so a slow host holds one request's coroutine and
  one slot, never the loop: every other request is answered meanwhile.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
import urllib.parse
import weakref
from typing import NamedTuple

import h11

from api.errors import APIError

SETTING = "--allowed-media-domains / FERROX_ALLOWED_MEDIA_DOMAINS"
MAX_REDIRECTS = 3
MAX_CONCURRENT_FETCHES = 16  # per event loop; a fetch holds a socket and at most one image's bytes
_READ_BYTES = 64 * 1024
_INLINE = 'send the image inline as a "data:image/png;base64,..." URL'

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


class Rules(NamedTuple):
    """What one fetch may do (from `ServerConfig`)."""

    allowed: tuple[str, ...]  # --allowed-media-domains entries, lowercased
    max_bytes: int  # the image byte limit; a longer body is cut off
    timeout_s: float  # the whole fetch, redirects included


def is_remote(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


def check_entries(entries: tuple[str, ...]) -> None:
    """Raises ValueError naming an entry that is neither a host name, a .domain, an address nor a network."""
    for entry in entries:
        name = entry[1:] if entry.startswith(".") else entry
        if _network(entry) is None and not (name and all(p and p.replace("-", "").replace("_", "").isalnum()
                                                          for p in name.split("."))):
            raise ValueError("ServerConfig.allowed_media_domains must be host names, '.example.com' for a domain "
                             f"and its hosts, IP addresses or networks (no scheme, port or path); got {entry!r}")


async def fetch(url: str, rules: Rules, param: str) -> bytes:
    """The bytes at `url` under `rules` (module docstring). Raises APIError 400 for every refusal."""
    if not rules.allowed:
        raise APIError(400, f"image URLs are not fetched by this server: no domain is allowed ({SETTING}); "
                            f"{_INLINE}", param=param)
    host = _split(url, param)[1]
    _check_listed(host, rules, param)
    try:
        async with asyncio.timeout(rules.timeout_s):
            async with _slot():
                return await _follow(url, rules, param)
    except TimeoutError:
        raise APIError(400, f"the image at {host} did not arrive within {rules.timeout_s:g} s (the server's "
                            f"limit for fetching an image); {_INLINE}, or use a faster host", param=param) from None


def _slot() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots[loop] = asyncio.Semaphore(MAX_CONCURRENT_FETCHES)
    return _slots[loop]


def _split(url: str, param: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path with query) of an http(s) URL."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise APIError(400, f"the image URL {url[:200]!r} is not a valid URL", param=param) from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise APIError(400, f"image URLs must be http:// or https:// (or inline data: URLs); got {scheme}://",
                       param=param)
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise APIError(400, f"the image URL {url[:200]!r} names no host", param=param)
    if parts.username is not None or parts.password is not None:
        raise APIError(400, "image URLs must not carry a user name or password", param=param)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return scheme, host, port or (443 if scheme == "https" else 80), path


def _network(entry: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(entry.strip("[]"), strict=False)
    except ValueError:
        return None


def _address_listed(address: _Address, rules: Rules) -> bool:
    return any((net := _network(e)) is not None and address.version == net.version and address in net
               for e in rules.allowed)


def _check_listed(host: str, rules: Rules, param: str) -> None:
    literal = _network(host)
    if literal is not None and literal.num_addresses == 1:
        if _address_listed(literal.network_address, rules):
            return
    elif any(host == e or (e.startswith(".") and (host == e[1:] or host.endswith(e))) for e in rules.allowed):
        return
    raise APIError(400, f"image URLs from {host} are not fetched: the host is not among the allowed media "
                        f"domains ({SETTING}); ask the operator to allow it, or {_INLINE}", param=param)


def _is_internal(address: _Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return not address.is_global or address.is_multicast


async def _checked_addresses(host: str, port: int, rules: Rules, param: str) -> list[str]:
    """Every address `host` resolves to, each checked (module docstring); the ones to connect to."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise APIError(400, f"the image host {host} could not be resolved; check the URL", param=param) from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for text in addresses:
        address = ipaddress.ip_address(text.split("%")[0])
        if _is_internal(address) and not _address_listed(address, rules):
            raise APIError(400, f"image URLs from {host} are not fetched: it resolves to {address}, an internal "
                                f"(loopback, private or link-local) address; the operator must list that address "
                                f"itself in {SETTING} to allow it", param=param)
    return addresses


async def _follow(url: str, rules: Rules, param: str) -> bytes:
    first_host = _split(url, param)[1]
    for _ in range(MAX_REDIRECTS + 1):
        scheme, host, port, path = _split(url, param)
        if host != first_host:
            raise APIError(400, f"the image URL redirects to another host ({host}); redirects are followed only "
                                f"within {first_host}: send the final URL", param=param)
        addresses = await _checked_addresses(host, port, rules, param)
        status, location, body = await _get(scheme, host, port, path, addresses, rules, param)
        if status in (301, 302, 303, 307, 308) and location:
            url = urllib.parse.urljoin(url, location)
            continue
        if status != 200:
            raise APIError(400, f"the image URL answered HTTP {status}; check the URL", param=param)
        return body
    raise APIError(400, f"the image URL redirects more than {MAX_REDIRECTS} times; send the final URL", param=param)


async def _connect(scheme: str, host: str, port: int, addresses: list[str],
                   param: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    context = ssl.create_default_context() if scheme == "https" else None
    for address in addresses:  # the checked addresses, in the resolver's order
        try:
            return await asyncio.open_connection(address, port, ssl=context,
                                                 server_hostname=host if context else None)
        except ssl.SSLCertVerificationError:
            raise APIError(400, f"the image host {host} has a certificate that does not verify", param=param) from None
        except OSError:
            continue
    raise APIError(400, f"could not connect to the image host {host}:{port}; check the URL", param=param)


async def _get(scheme: str, host: str, port: int, path: str, addresses: list[str], rules: Rules,
               param: str) -> tuple[int, str | None, bytes]:
    """One GET: (status, Location, body); the body only for a 200, cut off past `rules.max_bytes`."""
    reader, writer = await _connect(scheme, host, port, addresses, param)
    conn = h11.Connection(our_role=h11.CLIENT)
    default_port = 443 if scheme == "https" else 80
    name = f"[{host}]" if ":" in host else host  # an IPv6 literal
    headers = [("Host", name if port == default_port else f"{name}:{port}"), ("User-Agent", "ferrox"),
               ("Accept", "image/*"), ("Connection", "close")]
    try:
        writer.write(conn.send(h11.Request(method="GET", target=path, headers=headers)) + conn.send(h11.EndOfMessage()))
        await writer.drain()
        response = await _next(conn, reader, host, param)
        while isinstance(response, h11.InformationalResponse):  # 100 Continue and the like
            response = await _next(conn, reader, host, param)
        if not isinstance(response, h11.Response):
            raise APIError(400, f"the image host {host} closed the connection without answering", param=param)
        fields = {k.decode().lower(): v.decode("latin-1") for k, v in response.headers}
        if response.status_code != 200:
            return response.status_code, fields.get("location"), b""
        length = fields.get("content-length", "")
        if length.isdigit() and int(length) > rules.max_bytes:
            raise _too_big(host, rules, param)
        return 200, None, await _body(conn, reader, host, rules, param)
    except OSError:
        raise APIError(400, f"the connection to the image host {host} failed while reading; try again",
                       param=param) from None
    finally:
        writer.close()


async def _body(conn: h11.Connection, reader: asyncio.StreamReader, host: str, rules: Rules, param: str) -> bytes:
    chunks, size = [], 0
    while True:
        event = await _next(conn, reader, host, param)
        if isinstance(event, h11.Data):
            size += len(event.data)
            if size > rules.max_bytes:  # cut off here: the rest is never read
                raise _too_big(host, rules, param)
            chunks.append(event.data)
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        else:
            raise APIError(400, f"the image host {host} closed the connection before the whole image arrived",
                           param=param)


async def _next(conn: h11.Connection, reader: asyncio.StreamReader, host: str, param: str):
    try:
        while (event := conn.next_event()) is h11.NEED_DATA:
            conn.receive_data(await reader.read(_READ_BYTES))
    except h11.RemoteProtocolError:
        raise APIError(400, f"the image host {host} did not answer in HTTP/1.1", param=param) from None
    return event


def _too_big(host: str, rules: Rules, param: str) -> APIError:
    return APIError(400, f"the image at {host} is larger than {rules.max_bytes} bytes (--max-image-bytes); "
                         "send a smaller image", param=param)
