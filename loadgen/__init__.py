"""Trace synthesis (Zipf), trace replay, reports and plots, cache simulator, quality testbed."""
