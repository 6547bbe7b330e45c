"""The partition's network (devtools/netns.py): where it cannot be made it says why, and its addresses
stay inside the one private subnet it owns.

Making the namespaces needs root and is exercised by `make soak-ha` itself
(docs/failover.md#a-real-partition); these check what decides whether and where.
"""

from __future__ import annotations

import ipaddress

from devtools import netns


def test_namespaces_are_refused_with_a_reason_when_not_root(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)

    assert "not root" in (netns.why_not() or "")


def test_namespaces_are_refused_with_a_reason_without_iproute2(monkeypatch):
    monkeypatch.setattr(netns.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netns, "program", lambda name: None if name == "ip" else f"/usr/bin/{name}")

    assert "iproute2" in (netns.why_not() or "")


def test_every_address_is_in_the_private_subnet_and_each_node_has_its_own():
    network = netns.Network(["pg1", "pg2", "pg3"])
    addresses = [network.gateway, *network.addresses.values()]

    assert all(ipaddress.ip_address(a) in netns.SUBNET for a in addresses)
    assert len(set(addresses)) == len(addresses)
    assert netns.SUBNET.is_private
    assert all(network.namespace(n).startswith(netns.PREFIX) for n in network.nodes)
