"""Prediction before a job starts: hardware presets and the cost model."""
