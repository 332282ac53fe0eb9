"""The public face imports lazily: ``from prme import X`` works for every name it lists,
while a process that needs only the projectors (a rebuild worker, a server child) does not
load the clients' dependencies."""

from __future__ import annotations

import subprocess
import sys

import pytest

import prme


@pytest.mark.parametrize("name", prme.__all__)
def test_every_public_name_resolves(name: str) -> None:
    value = getattr(prme, name)
    assert value.__name__ == name
    assert name in dir(prme)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        prme.Nope  # noqa: B018


def test_a_rebuild_worker_does_not_import_the_clients() -> None:
    probe = (
        "import sys, prme.projectors.rebuild_worker, prme.projectors.runner\n"
        "print(sorted(m for m in ('fastembed', 'httpx', 'prme.query.client') if m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert loaded == "[]"
