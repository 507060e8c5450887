"""Test-wide settings: nothing here reaches a model or dataset hub.

``datasets`` runs offline for every test (child processes inherit it): a hub dataset name fails at once with the
offline error. Tests that name a hub tokenizer take ``hub_offline``, which does the same for huggingface_hub's
downloads without retries (not process-wide: the identity tests talk to a local Hugging Face endpoint through it).

Run as the README says (``-n 2 --dist loadgroup``, pytest-xdist), the tests that start real swarms
(``integration``) run one after another in one process while every other test runs in a second one: two
swarms never share the machine's two cores, and the quick tests take no time of their own.
"""

import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture
def hub_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def pytest_collection_modifyitems(config, items):
    for item in items:  # the groups --dist loadgroup keeps together (see above); without xdist the mark is inert
        item.add_marker(pytest.mark.xdist_group("swarms" if item.get_closest_marker("integration") else "others"))
