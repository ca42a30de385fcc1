"""Thin adapters to training frameworks; each is an optional extra."""
