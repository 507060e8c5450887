"""The contributor client's front end: the Textual app, its supervisor of the runtime process,
the headless runner and a recorded-stream replayer. Importing this package does not load Textual.
"""

from tui.supervisor import ChildCommand, RuntimeProcess, runtime_command

__all__ = ["ChildCommand", "RuntimeProcess", "runtime_command"]
