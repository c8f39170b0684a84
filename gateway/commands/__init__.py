"""Subcommands of `tierlane` that read the gateway settings (state directory, policy)."""
