"""The drafting kinds, each in a folder of its own: its drafter (config, modules, loss,
decoding settings), its session, its exports and its trainer (docs/architecture.md, "Layout")."""
