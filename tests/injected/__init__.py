"""Targets with one injected bug each, used to test that the harness catches, records and replays failures."""
