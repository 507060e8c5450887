#!/usr/bin/env python3
"""Agora contributor client and swarm roles. Run with no arguments to join the swarm."""

import sys

from agora_client.cli import main

if __name__ == "__main__":
    sys.exit(main())
