"""Whom a connection counts against (app/api/http_protocol.py::Bounds.peer), and FORWARDED_ALLOW_IPS refused when
it would silently trust nobody.

A peer is an IPv4 address, or an IPv6 /64: one host is usually given a
whole /64, so an attacker's many addresses in it count as one. The trusted
proxies are not counted at all: every connection of a balancer comes from
its own address.
"""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import ValidationError

from app.api.http_protocol import Bounds
from app.config import Settings


def test_an_ipv4_peer_is_its_address_and_an_ipv4_mapped_one_the_same():
    bounds = Bounds(trusted_proxies=())
    assert bounds.peer(("192.0.2.7", 5000)) == ipaddress.ip_address("192.0.2.7")
    assert bounds.peer(("::ffff:192.0.2.7", 5000)) == ipaddress.ip_address("192.0.2.7")


def test_ipv6_addresses_in_one_64_are_one_peer():
    bounds = Bounds(trusted_proxies=())
    one, other = bounds.peer(("2001:db8:1:2::1", 1)), bounds.peer(("2001:db8:1:2:ffff::9", 1))
    assert one == other == ipaddress.ip_network("2001:db8:1:2::/64")
    assert bounds.peer(("2001:db8:1:3::1", 1)) != one


def test_trusted_proxies_by_address_or_network_are_not_counted():
    bounds = Bounds(trusted_proxies=("127.0.0.1", "10.0.0.0/8", "fd00::/8"))
    assert bounds.peer(("127.0.0.1", 1)) is None
    assert bounds.peer(("::ffff:127.0.0.1", 1)) is None
    assert bounds.peer(("10.1.2.3", 1)) is None
    assert bounds.peer(("fd00::5", 1)) is None
    assert bounds.peer(("127.0.0.2", 1)) == ipaddress.ip_address("127.0.0.2")
    assert Bounds(trusted_proxies=("*",)).peer(("192.0.2.7", 1)) is None
    assert bounds.peer(None) is None  # no peer address (not an IP socket): nothing to count


def test_the_default_trusts_the_loopback_proxy_as_uvicorn_does():
    settings = Settings(database_url="postgresql://u:p@h/d")
    assert settings.trusted_proxies == ["127.0.0.1", "::1"]
    assert Settings(database_url="postgresql://u:p@h/d", forwarded_allow_ips="").trusted_proxies == []
    assert Settings(database_url="postgresql://u:p@h/d", forwarded_allow_ips="10.0.0.1, *").trusted_proxies == ["*"]


@pytest.mark.parametrize("value", ["nginx", "10.0.0.1/8", "127.0.0.1,localhost"])
def test_a_forwarded_allow_ips_entry_that_is_no_address_refuses_start_up(value):
    # uvicorn would take it as a literal that never matches: the balancer
    # would then be bounded as one client.
    with pytest.raises(ValidationError, match="not an IP address or network"):
        Settings(database_url="postgresql://u:p@h/d", forwarded_allow_ips=value)
