"""The order of the pipeline, declared once.

Stages run in this order before the lane; the first one that returns an Answer ends the
walk. Completion hooks run, in order, after the client has the answer.
"""

STAGES: list[str] = [
]

HOOKS: list[str] = [
]
