"""Learned templates: the repeated tasks an operator names, and the upstream answers kept to teach the edge them.

config: the `learn` policy section; templates: which template a request is (pure, precomputed per
tenant/app); admission: which answers are worth keeping; pairs: the (input, answer) store a trainer reads.
"""
