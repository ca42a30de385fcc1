"""Thin adapters to training frameworks; each is an optional extra."""

# The TRL release whose semantics the drop-ins reproduce; here (no imports) so that the CLI's
# `env` reads it without importing TRL or torch.
TESTED_TRL = "1.16"
