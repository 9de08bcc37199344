"""Which policy endpoints EvalForge may connect to: ``EVALFORGE_POLICY_HOSTS``, checked in one place.

Registering a policy makes the API open a connection to a URL a user typed, and every
episode makes a worker open one to the registered URL: without a limit, an API key is a
way to probe the network the API and the workers sit in. ``EVALFORGE_POLICY_HOSTS``
lists the hosts that may serve policies, as host names (``gpu-3``, ``policy.lab``, matched
exactly, case-insensitively) or IP networks (``10.0.0.0/8``, ``127.0.0.1``, ``fd00::/8``),
comma-separated or as a JSON list. Empty (the default) allows any host, which suits one
machine or a trusted network; set it on any deployment that takes keys from others.

``POST /policies`` refuses an endpoint outside the list (422) and a worker refuses to
connect to one (the episode fails with ``endpoint_refused``, so a policy registered
before the list was narrowed is never scored). Both read this module's settings class,
so the two can never disagree.

A host name is allowed when it is listed, or when every address it resolves to lies in a
listed network. The connection resolves the name again, so a DNS server that answers
differently the second time (rebinding) is not caught: list IP networks and use IP
endpoints, or names only your DNS serves, where that matters.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class EndpointRefused(ValueError):
    """A policy endpoint EvalForge will not connect to (credentials in it, or a host outside the list)."""


def _split(value: object) -> object:
    """``a, b`` or ``["a", "b"]`` (JSON, as pydantic-settings reads lists) → a list of entries."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                return json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"EVALFORGE_POLICY_HOSTS {text[:80]!r} is not a JSON list: {exc}") from exc
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


class PolicyHostsSettings(BaseSettings):
    """``EVALFORGE_POLICY_HOSTS``: the one setting the API and the workers share about policy endpoints."""

    model_config = SettingsConfigDict(env_prefix="EVALFORGE_", populate_by_name=True, extra="ignore")

    policy_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list, description=(
        "Hosts that may serve policies, comma-separated: host names (exact) or IP networks "
        "(`10.0.0.0/8`, `127.0.0.1`). `POST /policies` refuses other endpoints (422) and workers "
        "refuse to connect to them (episode fails `endpoint_refused`). Empty: any host."))

    @field_validator("policy_hosts", mode="before")
    @classmethod
    def _parse(cls, value: object) -> object:
        return _split(value)

    @field_validator("policy_hosts")
    @classmethod
    def _valid(cls, entries: list[str]) -> list[str]:
        HostAllowList.parse(entries)  # raises ValueError naming the bad entry
        return entries

    def allow_list(self) -> HostAllowList:
        return HostAllowList.parse(self.policy_hosts)


@dataclass(frozen=True, slots=True)
class HostAllowList:
    """Parsed ``EVALFORGE_POLICY_HOSTS``: names (lower case) and networks; both empty = any host."""

    names: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, entries: Iterable[str]) -> HostAllowList:
        names: set[str] = set()
        networks: list[Network] = []
        for raw in entries:
            entry = raw.strip()
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
                continue
            except ValueError:
                pass
            if "/" in entry or any(c.isspace() for c in entry) or ":" in entry or "@" in entry:
                raise ValueError(f"EVALFORGE_POLICY_HOSTS entry {entry!r} is neither a host name nor an IP "
                                 "network; write e.g. `gpu-3`, `10.0.0.0/8` or `127.0.0.1`")
            names.add(entry.lower().rstrip("."))
        return cls(frozenset(names), tuple(networks))

    @property
    def allows_any(self) -> bool:
        return not self.names and not self.networks

    def _in_networks(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        return any(ip.version == net.version and ip in net for net in self.networks)

    def allows(self, host: str) -> bool:
        """Whether ``host`` (a name or an IP literal, as in a URL) is allowed; resolves names if networks are listed."""
        if self.allows_any:
            return True
        host = host.strip("[]").lower().rstrip(".")
        try:
            ipaddress.ip_address(host.split("%", 1)[0])
        except ValueError:
            pass
        else:
            return host in self.names or self._in_networks(host)
        if host in self.names:
            return True
        if not self.networks:
            return False
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return False  # an unknown name is in no network
        addresses = {info[4][0] for info in infos}
        return bool(addresses) and all(self._in_networks(a) for a in addresses)


def endpoint_host(endpoint: str) -> str:
    """The host of a ws:// or wss:// URL; ``EndpointRefused`` if it has credentials or no host."""
    try:
        parts = urlsplit(endpoint)
        host = parts.hostname
    except ValueError as exc:
        raise EndpointRefused(f"policy endpoint {endpoint[:200]!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("ws", "wss"):
        raise EndpointRefused(f"policy endpoint {endpoint[:200]!r} is not a ws:// or wss:// URL")
    if "@" in parts.netloc:
        raise EndpointRefused("policy endpoint has credentials in it (user:password@); EvalForge does not "
                              "send them and will not store them: give the URL without them")
    if not host:
        raise EndpointRefused(f"policy endpoint {endpoint[:200]!r} names no host")
    return host


def check_endpoint(endpoint: str, allowed: HostAllowList | None = None) -> None:
    """Raise ``EndpointRefused`` unless EvalForge may connect to ``endpoint``.

    ``allowed`` defaults to ``EVALFORGE_POLICY_HOSTS`` as the environment says now.
    """
    host = endpoint_host(endpoint)
    allowed = allowed if allowed is not None else PolicyHostsSettings().allow_list()
    if not allowed.allows(host):
        raise EndpointRefused(f"policy endpoint host {host!r} is not in EVALFORGE_POLICY_HOSTS; serve the policy "
                              "from an allowed host, or add this one to EVALFORGE_POLICY_HOSTS")
