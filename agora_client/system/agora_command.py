"""The command line that runs this copy of the ``agora`` CLI in a child process, whatever the child's cwd."""

from __future__ import annotations

import sys
from pathlib import Path

import agora_client

_ROOT = str(Path(agora_client.__file__).resolve().parent.parent)
# `python -c` with an explicit sys.path runs the parent's agora_client, from a checkout and from an installed package
# alike, whether or not the child's cwd holds it
AGORA = (
    sys.executable,
    "-c",
    f"import sys; sys.path.insert(0, {_ROOT!r}); from agora_client.cli import main; sys.exit(main())",
)
