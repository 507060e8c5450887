"""The Textual app: state, screens, widgets and styles. It draws what agora_client.frontend reads;
the supervisor, stream reader, exit codes and headless printer live there, not here."""
