"""Test-wide settings: nothing here reaches a model or dataset hub, or Hugging Face at all.

``datasets`` runs offline for every test (child processes inherit it): a hub dataset name fails at once with the
offline error. Tests that name a hub tokenizer take ``hub_offline``, which does the same for huggingface_hub's
downloads without retries (not process-wide: the identity tests talk to a local Hugging Face endpoint through it).
"""

import os
from pathlib import Path

import psutil
import pytest

from agora_client.system.lifetime import exit_process

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# Hugging Face itself is a closed port on this machine: a client asking whoami what a token may do, or an auth
# service asking whose it is, fails at once instead of reaching the internet; whoami tests set a local stand-in.
os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
SESSION = pytest.StashKey[pytest.Session]()


@pytest.fixture
def hub_offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """hivemind shares tensors through /dev/shm/torch_<pid>_* files (torch's file_system strategy), which their
    process's torch_shm_manager unlinks; a test that kills a process tree or a namespace's processes kills managers
    too. At the end, remove the files this run made whose process is gone and that no live process maps: a tensor
    received from a child maps its file, and torch aborts the process that frees it if the file is gone by then."""
    shared_memory = Path("/dev/shm")
    before = set(shared_memory.glob("torch_*"))
    yield
    mapped = mapped_paths()
    for path in set(shared_memory.glob("torch_*")) - before:
        if not psutil.pid_exists(int(path.name.split("_")[1])) and str(path) not in mapped:
            path.unlink(missing_ok=True)


def mapped_paths() -> set[str]:
    paths: set[str] = set()
    for process in psutil.process_iter():
        try:
            paths.update(region.path for region in process.memory_maps(grouped=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return paths


def pytest_sessionfinish(session):
    session.config.stash[SESSION] = session  # its exitstatus is final only once every plugin's sessionfinish ran


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Once every result is reported, leave with pytest's exit status and without the interpreter's teardown, as the
    engine commands do (exit_process). The teardown frees tensors this process received from children; one whose
    /dev/shm file is already gone makes torch abort ("could not unlink the shared memory file"), turning a run whose
    every test passed into exit 134 (a clean run on 2026-11-28; which process removed the file is not known)."""
    if SESSION in config.stash:
        exit_process(int(config.stash[SESSION].exitstatus))
