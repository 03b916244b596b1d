"""Who may reach the API from a browser: the Host names it answers to, the origins that may
change its state, and the content type a body must declare.

A web page the user happens to visit can send requests to a server on their machine: a
"simple" cross-origin request (`fetch(..., {mode: "no-cors"})` or an HTML form) needs no
CORS preflight as long as its body is `text/plain`, a form or multipart, or a Blob with no
type at all. The page cannot read the answer, but the server acts on it: without a key
(the default, on loopback) that could put the server to sleep or resize its cache. And a
page on a name the attacker re-points to 127.0.0.1 (DNS rebinding) is, to the browser, on
the same origin as the server, so it could also read the answers. `SameOrigin.check`
refuses all three, in the route's own error envelope (`api/app.py` calls it for every
request, before the CORS preflight answer and the API key):

1. **Host** (421 Misdirected Request, every method): the `Host` header must name this
   server. A name is accepted when it is `localhost`, the bound address, or one of
   `--allowed-hosts` (`FERROX_ALLOWED_HOSTS`: names, `.example.com` for a domain and its
   subdomains, `*` for any); an IP literal is always accepted (a rebinding page always
   comes under a name, and Kubernetes probes send `Host: <pod-ip>:<port>`); the port is
   not compared. Without `--allowed-hosts` a server bound to a loopback address accepts
   no other name, which is what closes DNS rebinding on the default setup; a server bound
   to any other address (0.0.0.0, ::, a LAN address) was started to be reached by
   whatever names its clients use, so it accepts any name until `--allowed-hosts` lists
   them. A request with no Host header (HTTP/1.0) comes from no browser and passes.
2. **Origin** (403, every method but GET, HEAD and OPTIONS): browsers send `Origin` with
   every such request, no-cors and form posts included (`null` from sandboxed pages or a
   `no-referrer` policy). When present it must be this server's own origin (the Host
   header's host and port; the scheme is not compared, so a TLS-terminating proxy that
   passes the Host through keeps the pages working) or one of `--cors-origins`. With no
   Origin, `Sec-Fetch-Site: cross-site` or `same-site` (a browser telling that another
   origin made the request) is refused the same way. Clients outside a browser (the
   openai and anthropic SDKs, curl) send neither and pass.
3. **Content-Type** (415, the same methods): a declared Content-Type must be JSON
   (`application/json` or an `application/*+json` type, parameters allowed) unless the
   request says it has no body (`Content-Length: 0`: some HTTP libraries label even an
   empty POST, such as `POST /wake_up`, as a form). No Content-Type at all is read as JSON, as FastAPI does, for clients such
   as `requests.post(url, data=text)`. Every route that takes a body takes JSON, so the
   rule is here rather than in each route. A browser can send a typeless body cross-site
   (a Blob); rule 2 refuses that request.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Mapping
from urllib.parse import urlsplit

from api.config import ServerConfig, is_loopback
from api.errors import APIError

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})  # read-only: no origin or body rule
LOCAL_NAMES = frozenset({"localhost"})
DEFAULT_PORTS = {"http": 80, "https": 443}
# Sec-Fetch-Site values meaning another origin made the request ("same-site" includes
# another port on the same host).
OTHER_ORIGIN_SITES = frozenset({"cross-site", "same-site"})
# A Host header: a bracketed IPv6 literal or a name / IPv4 literal, then an optional port.
_HOST = re.compile(r"^(?:\[(?P<v6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9._-]+))(?::(?P<port>[0-9]{1,5}))?$")
CURL_HINT = "-H 'Content-Type: application/json'"


def split_host(value: str) -> tuple[str, int | None] | None:
    """`Host` header -> (lowercase host without brackets or trailing dot, port or None);
    None when it is not a host[:port]."""
    match = _HOST.match(value.strip().lower())
    if match is None:
        return None
    host = match["v6"] or match["name"].rstrip(".")
    return host, int(match["port"]) if match["port"] else None


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def is_json_type(content_type: str) -> bool:
    """`application/json` or `application/<anything>+json`, any parameters."""
    mime = content_type.split(";", 1)[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and mime.endswith("+json"))


class SameOrigin:
    """The three rules above for one server's settings; stateless after construction."""

    def __init__(self, config: ServerConfig) -> None:
        entries = tuple(e.lower() for e in config.allowed_hosts)
        if not entries and not is_loopback(config.host):
            entries = ("*",)  # bound for remote clients: any name until --allowed-hosts lists them
        self.any_host = "*" in entries
        bound = config.host.lower().strip("[]")
        self.names = frozenset({e for e in entries if not e.startswith(".")} | LOCAL_NAMES | {bound})
        self.domains = tuple(e for e in entries if e.startswith("."))
        self.cors_origins = frozenset(config.cors_origins)

    def check(self, method: str, headers: Mapping[str, str]) -> None:
        """Raise the 421, 403 or 415 `APIError` a request gets; return for one that passes."""
        host = headers.get("Host")
        parts = None if host is None else split_host(host)
        if host is not None and (parts is None or not self.host_allowed(parts[0])):
            raise APIError(421, f"this server does not answer to the host name in 'Host: {host[:200]}'; "
                                "reach it by an address it serves (localhost or its IP address), or start it "
                                "with that name in --allowed-hosts (FERROX_ALLOWED_HOSTS)",
                           code="misdirected_request")
        if method.upper() in SAFE_METHODS:
            return
        origin = headers.get("Origin")
        if origin is not None and not self.origin_allowed(origin, parts):
            raise APIError(403, f"requests from the web page at Origin {origin[:200]!r} may not change this "
                                "server; a page on another origin may call it only when the server lists that "
                                "origin in --cors-origins (FERROX_CORS_ORIGINS)", code="origin_not_allowed")
        if origin is None and headers.get("Sec-Fetch-Site", "").lower() in OTHER_ORIGIN_SITES:
            raise APIError(403, "requests from a web page on another origin may not change this server; list the "
                                "page's origin in --cors-origins (FERROX_CORS_ORIGINS)", code="origin_not_allowed")
        content_type = headers.get("Content-Type")
        if content_type is not None and not is_json_type(content_type) and headers.get("Content-Length") != "0":
            raise APIError(415, f"this route takes a JSON body: send it with 'Content-Type: application/json' "
                                f"(curl: {CURL_HINT}); got Content-Type {content_type[:100]!r}",
                           code="unsupported_media_type")

    def host_allowed(self, host: str) -> bool:
        return (self.any_host or host in self.names or is_ip_literal(host)
                or any(host == d[1:] or host.endswith(d) for d in self.domains))

    def origin_allowed(self, origin: str, host: tuple[str, int | None] | None) -> bool:
        """`origin` is listed in --cors-origins, or is this server's own origin: the host and
        port the request was sent to (`host`, from the Host header)."""
        if origin in self.cors_origins:
            return True
        if host is None:
            return False
        try:
            parts = urlsplit(origin)
            port = parts.port
        except ValueError:  # a port out of range or not a number
            return False
        if parts.scheme not in DEFAULT_PORTS or parts.hostname is None:  # "null", file://, ...
            return False
        name, host_port = host
        return (parts.hostname.rstrip(".") == name
                and (port or DEFAULT_PORTS[parts.scheme]) == (host_port or DEFAULT_PORTS[parts.scheme]))
