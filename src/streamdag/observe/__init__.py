"""Observation: explain, DOT. Pure functions over schedules and timings."""
