"""specdec draft model server: `python -m draft_server --model PATH ...`."""
