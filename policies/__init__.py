"""Policies: trimming, semantic cache, router, pricing and budgets, configured from YAML."""
