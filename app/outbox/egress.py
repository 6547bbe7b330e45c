"""The webhook egress policy: which URLs may be registered, which addresses the dispatcher may connect to.

Where it sits: under registration (`checked_url`, called by
app/outbox/endpoints.py for `payments clients set-webhook`) and under the
dispatcher's HTTP client (`connector`, app/outbox/delivery.py::session),
where it protects: every address is judged after resolution, at every
connection, by aiohttp's resolver hook (`PermittedResolver`, for names) and
the connector's socket factory (for every address, literals included), so a
name that resolves inside at delivery time reaches nothing. Permitted: a
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

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

# What an attempt to a refused address records (the attempt's `error`).
REFUSED = "refused by the egress policy: the endpoint's address is not public"
NOT_HTTPS = "refused by the egress policy: the endpoint is not https"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class InvalidWebhookUrl(ValueError):
    """A URL the policy will not register: not https (or http when allowed), credentials, a refused address."""


class RefusedAddress(OSError):
    """Raised under aiohttp for an address the policy refuses; aiohttp wraps it in a ClientConnectorError."""

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

    def ssl_context(self) -> ssl.SSLContext | bool:
        """The TLS trust of the dispatcher: WEBHOOK_CA_FILE's CAs, else the system's (True: aiohttp's default)."""
        if self.ca_file is None:
            return True
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


class PermittedResolver(AbstractResolver):
    """aiohttp's default resolver, keeping only the addresses the policy permits (RefusedAddress if none)."""

    def __init__(self, policy: EgressPolicy, resolver: AbstractResolver | None = None) -> None:
        self.policy = policy
        self.resolver = resolver or aiohttp.DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        permitted = [r for r in await self.resolver.resolve(host, port, family) if self.policy.permits(r["host"])]
        if not permitted:
            raise RefusedAddress()
        return permitted

    async def close(self) -> None:
        await self.resolver.close()


def connector(policy: EgressPolicy, **options) -> aiohttp.TCPConnector:
    """aiohttp's connector under the policy: the resolver filters names, the socket factory every address."""

    def socket_factory(addr_info: tuple) -> socket.socket:
        family, type_, proto, _, sockaddr = addr_info
        if not policy.permits(str(sockaddr[0])):
            raise RefusedAddress()
        return socket.socket(family, type_, proto)

    return aiohttp.TCPConnector(resolver=PermittedResolver(policy), socket_factory=socket_factory,
                                ssl=policy.ssl_context(), **options)


def development(networks: Iterable[str] = ("127.0.0.0/8", "::1/128")) -> EgressPolicy:
    """The policy of a development machine: http allowed, loopback allowed (the fake merchant)."""
    return EgressPolicy(True, parse_networks(",".join(networks)))
