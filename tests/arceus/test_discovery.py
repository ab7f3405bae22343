"""What discovery accepts and how a control plane is chosen without the network (arceus.discovery); browsing
and advertising over multicast are tested inside network namespaces (tests/e2e/test_sdk_discovery.py), where
the test's multicast stays."""

from __future__ import annotations

import pytest

from arceus.discovery import DiscoveryError, Found, check_url, control_plane_url


@pytest.mark.parametrize("url", ["http://10.0.0.2:8000", "https://arceus.example.org/", "http://[::1]:8000"])
def test_a_base_url_is_kept_without_its_trailing_slash(url: str) -> None:
    assert check_url(url) == url.rstrip("/")


@pytest.mark.parametrize(("url", "problem"), [
    ("ftp://host", "http:// or https://"),
    ("javascript:alert(1)", "http:// or https://"),
    ("http://", "names a host"),
    ("http://user:pw@host", "no credentials"),
    ("http://host/?next=evil", "no credentials, query or fragment"),
    ("http://host:99999", "out of range"),
    ("http://" + "a" * 3000, "at most 2048"),
])
def test_what_an_advertisement_may_not_hold_is_refused_by_name(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_url(url)


def test_a_given_url_wins_and_is_checked() -> None:
    assert control_plane_url("auto", given="http://cp:8000/", configured=None, configured_by="ARCEUS_URL") == \
        Found(url="http://cp:8000", service="given")
    with pytest.raises(ValueError, match="http:// or https://"):
        control_plane_url("url", given="cp:8000", configured=None, configured_by="ARCEUS_URL")


def test_a_configured_url_wins_over_discovery_except_when_asking_for_mdns_only() -> None:
    for method in ("url", "auto"):  # "auto" browses only when nothing is configured (forged answers: security.md)
        found = control_plane_url(method, given=None, configured="http://cp:8000", configured_by="ARCEUS_URL")
        assert found == Found(url="http://cp:8000", service="ARCEUS_URL")


def test_the_url_method_says_how_to_give_one() -> None:
    with pytest.raises(DiscoveryError, match="pass url=..., set ARCEUS_URL, or discover one"):
        control_plane_url("url", given=None, configured=None, configured_by="ARCEUS_URL")


def test_an_unknown_method_is_named() -> None:
    with pytest.raises(ValueError, match="auto, mdns, url, got 'bonjour'"):
        control_plane_url("bonjour", given=None, configured=None, configured_by="ARCEUS_URL")
