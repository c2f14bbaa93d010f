"""specdec target model server: `python -m target_server --model PATH ...`."""
