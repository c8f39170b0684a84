"""Replay a recorded or generated workload against a running gateway and report what it did."""
