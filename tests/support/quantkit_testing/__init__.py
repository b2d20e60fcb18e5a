"""The tests' helpers: tiny models and tokenizers, oracles, the served process, the fake OpenAI server.

One package under a name that is ours (tests/support is on the path through pyproject's `pythonpath`;
nothing else of tests/ is), so an installed distribution can neither shadow these modules nor be
shadowed by them (tests/test_import_names.py checks it)."""
