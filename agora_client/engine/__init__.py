"""The engine boundary: every use of a hivemind or libp2p internal, each behind a small function or subclass.

Nothing outside this package touches a private name of hivemind; tests/test_engine_contract.py checks each
internal used here against the installed hivemind, so an upgrade that moves one fails there, naming it.
"""
