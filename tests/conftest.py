"""Test-wide settings: nothing here reaches a model or dataset hub, or Hugging Face at all.

``datasets`` runs offline for every test (child processes inherit it): a hub dataset name fails at once with the
offline error. Tests that name a hub tokenizer take ``hub_offline``, which does the same for huggingface_hub's
downloads without retries (not process-wide: the identity tests talk to a local Hugging Face endpoint through it).
"""

import os

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Hugging Face itself is a closed port on this machine: a client asking whoami what a token may do, or an auth
# service asking whose it is, fails at once instead of reaching the internet; whoami tests set a local stand-in.
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")


@pytest.fixture
def hub_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
