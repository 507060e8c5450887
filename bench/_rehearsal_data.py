"""The rehearsal's run config (bench/rehearsal.py): tiny with the run's own tokenizer.

The tokenizer is trained by `agora tokenizer train` on a corpus the rehearsal makes from the repository's own text
(its Python and Markdown files, one .txt document each); pinned by its sha256 in the run config, it is the file the
auth service serves to every contributor. The training data stays tiny's (the standard library's source, streamed
with `datasets`, each trainer its own shard, documents held out by hash for the held-out eval). The spot checks are
raised (``SPOT_CHECKS``) so that the liar is caught within the run.
"""

from __future__ import annotations

import hashlib
import subprocess
from importlib import resources
from pathlib import Path

import yaml

from agora_client.swarm.processes import CLI

REPO = Path(__file__).resolve().parents[1]
CORPUS_GLOBS = ("agora_client/**/*.py", "tui/**/*.py", "bench/*.py", "tests/*.py", "docs/*.md", "*.md")
TRAIN_TIMEOUT_S = 600.0
# a quarter of the requests checked against a second worker, judged after 10 honest distances: the liar is caught
# within minutes (the default, 2% after 30, would take most of a 40-minute run)
SPOT_CHECKS = {"fraction": 0.25, "min_samples": 10, "strikes": 3}


def make_corpus(folder: Path) -> int:
    """The repository's text as one .txt document per file; how many."""
    folder.mkdir(parents=True, exist_ok=True)
    files = sorted({path for pattern in CORPUS_GLOBS for path in REPO.glob(pattern) if path.is_file()})
    for number, path in enumerate(files):
        (folder / f"{number:05d}.txt").write_text(path.read_text(encoding="utf-8", errors="replace"), encoding="utf-8")
    return len(files)


def run_config(root: Path, preset: str) -> tuple[Path, dict]:
    """Train the run's tokenizer and write the run config that names it; (its path, what to say about it)."""
    documents = make_corpus(root / "corpus")
    tokenizer = root / "tokenizer.json"
    config = yaml.safe_load((resources.files("agora_client") / "presets" / f"{preset}.yaml").read_text())
    trained = subprocess.run(
        [
            *CLI,
            "tokenizer",
            "train",
            "--out",
            str(tokenizer),
            "--vocab-size",
            str(config["model"]["vocab_size"]),
            "--data",
            str(root / "corpus"),
        ],
        capture_output=True,
        text=True,
        timeout=TRAIN_TIMEOUT_S,
    )
    if trained.returncode != 0:
        raise RuntimeError(f"agora tokenizer train failed:\n{trained.stdout}{trained.stderr}")
    sha256 = hashlib.sha256(tokenizer.read_bytes()).hexdigest()
    config["tokenizer"] = {**config["tokenizer"], "source": str(tokenizer), "sha256": sha256}
    config["spot_checks"] = {**config.get("spot_checks", {}), **SPOT_CHECKS}
    path = root / f"{preset}-rehearsal.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, {"corpus_documents": documents, "tokenizer": str(tokenizer), "sha256": sha256}
