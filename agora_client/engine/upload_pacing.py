"""What the engine's senders await before they hand a message's bytes to hivemind's p2p daemon.

The daemon writes the sockets, so an upload cap can only pace the hand-over (agora_client/upload_cap.py).
"""

from __future__ import annotations

from typing import Protocol


class UploadPacer(Protocol):
    async def pace(self, nbytes: int) -> None:
        """Return once ``nbytes`` may be sent."""
