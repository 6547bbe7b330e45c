"""The webhook egress policy: which URLs may be registered, which addresses the dispatcher may connect to.

Where it sits: under registration (`checked_url`, called by
app/outbox/endpoints.py for `payments clients set-webhook`) and under the
dispatcher's HTTP client (app/outbox/http1.py), where it protects: every
address a host resolves to (a literal resolves to itself) is judged by
`permitted` before a socket is made for it, at every connection, so a name
that resolves inside at delivery time reaches nothing. Permitted: a
global unicast address (the standard library's `ipaddress`) whose embedded
IPv4 address, if any, is one too; or one in WEBHOOK_ALLOWED_NETWORKS
(development). A refused address is recorded as one phrase, `REFUSED`.
docs/outbox-inbox.md#egress-where-the-dispatcher-may-connect explains what
is refused and why.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

# What an attempt to a refused address records (the attempt's `error`).
REFUSED = "refused by the egress policy: the endpoint's address is not public"
NOT_HTTPS = "refused by the egress policy: the endpoint is not https"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class InvalidWebhookUrl(ValueError):
    """A URL the policy will not register: not https (or http when allowed), credentials, a refused address."""


class RefusedAddress(OSError):
    """Raised by `permitted` when the policy refuses every address an endpoint's host has."""

    def __init__(self) -> None:
        super().__init__(REFUSED)


def parse_networks(value: str) -> tuple[Network, ...]:
    """WEBHOOK_ALLOWED_NETWORKS: comma-separated addresses or CIDR networks (127.0.0.0/8, ::1)."""
    return tuple(ipaddress.ip_network(item.strip(), strict=False) for item in value.split(",") if item.strip())


def _public(address: Address) -> bool:
    if not address.is_global or address.is_multicast or address.is_reserved:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        embedded = [address.ipv4_mapped, address.sixtofour, *(address.teredo or ())]
        return all(_public(v4) for v4 in embedded if v4 is not None)
    return True


@dataclass(frozen=True)
class EgressPolicy:
    """What the dispatcher may reach; the default refuses everything but public https."""

    allow_http: bool = False
    allowed_networks: tuple[Network, ...] = ()
    ca_file: str | None = None  # a PEM bundle trusted instead of the system's (WEBHOOK_CA_FILE)

    @classmethod
    def from_settings(cls, settings) -> EgressPolicy:
        return cls(settings.webhook_allow_http, parse_networks(settings.webhook_allowed_networks),
                   settings.webhook_ca_file)

    def permits(self, host: str) -> bool:
        """Whether the dispatcher may connect to this address (text, as a socket address gives it)."""
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False  # not an address at all: nothing to connect to
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            in_allowed = address in self or address.ipv4_mapped in self
        else:
            in_allowed = address in self
        return in_allowed or _public(address)

    def __contains__(self, address: Address) -> bool:
        return any(address.version == n.version and address in n for n in self.allowed_networks)

    def permits_scheme(self, url: str) -> bool:
        return url.startswith("https://") or (self.allow_http and url.startswith("http://"))

    def checked_url(self, url: str) -> str:
        """The URL if it may be registered; InvalidWebhookUrl saying why not."""
        parts = urlsplit(url)
        # First, so that no message below repeats a password.
        if parts.username is not None or parts.password is not None:
            raise InvalidWebhookUrl("a webhook URL carries no user:password@; the endpoint verifies the signature")
        schemes = ("https", "http") if self.allow_http else ("https",)
        if parts.scheme not in schemes or not parts.hostname:
            spelled = " or ".join(f"{s}://" for s in schemes)
            hint = "" if self.allow_http or parts.scheme != "http" else " (http only with WEBHOOK_ALLOW_HTTP=true)"
            raise InvalidWebhookUrl(f"a webhook URL is an absolute {spelled} URL, not {url!r}{hint}")
        try:
            port = parts.port
        except ValueError:
            raise InvalidWebhookUrl(f"not a valid port in {url!r}") from None
        refused = [a for a in _addresses_now(parts.hostname, port) if not self.permits(a)]
        if refused:
            raise InvalidWebhookUrl(
                f"{parts.hostname} is {refused[0]}, not a public address: the dispatcher will not connect to it "
                "(development: WEBHOOK_ALLOWED_NETWORKS)"
            )
        return url

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS trust of the dispatcher: WEBHOOK_CA_FILE's CAs, else the system's; certificates and names checked."""
        return ssl.create_default_context(cafile=self.ca_file)


def _addresses_now(host: str, port: int | None) -> list[str]:
    """What `host` is now: the address it spells, else what it resolves to; nothing if it does not resolve."""
    host = host.strip("[]")
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        try:
            found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError):
            return []  # not resolvable today; checked again at every connection
    return [str(info[4][0]) for info in found]


def permitted(policy: EgressPolicy, found: Iterable[tuple]) -> list[tuple]:
    """The addresses of `found` (getaddrinfo's tuples) the policy permits, in their order; RefusedAddress if none.

    An address refused and one that does not listen read the same to the
    caller (one phrase, REFUSED): nothing tells which inside ports are open.
    """
    kept = [info for info in found if policy.permits(str(info[4][0]))]
    if not kept:
        raise RefusedAddress()
    return kept


def development(networks: Iterable[str] = ("127.0.0.0/8", "::1/128")) -> EgressPolicy:
    """The policy of a development machine: http allowed, loopback allowed (the fake merchant)."""
    return EgressPolicy(True, parse_networks(",".join(networks)))
