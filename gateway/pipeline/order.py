"""The order of the pipeline, declared once.

Each entry is (module, policy section). The module's `build(services)` makes the stage or
hook; it is skipped when its policy section says `enabled: false` (an entry without a section
always runs). Stages run in this order before the lane, and the first one that returns an
Answer ends the walk; completion hooks run in order after the client has its answer.
"""

STAGES: list[tuple[str, str | None]] = [
    ("gateway.pipeline.resolve", None),  # first: model name and route header give the lane; bad ones end here
    ("gateway.pipeline.budget", "budgets"),  # limits are counted before any work is done
    ("gateway.pipeline.cache_lookup", "cache"),  # exact, then semantic + verification; may answer
    ("gateway.pipeline.route", "router"),  # picks the lane for `auto`; enforces lane policy for all
    ("gateway.pipeline.learned", "learn"),  # a learned template whose gate serves: its adapter answers
    ("gateway.pipeline.trim", "trim"),  # after routing, so tokens are counted for the chosen lane
]

HOOKS: list[tuple[str, str | None]] = [
    ("gateway.pipeline.cache_store", "cache"),  # admits complete, successful answers only
    ("gateway.pipeline.learn_collect", "learn"),  # keeps upstream answers to the templates named to learn
    ("gateway.pipeline.shadow", "shadow"),  # samples cache/edge answers against the upstream, in the background
    ("gateway.pipeline.meter", None),  # last: it bills what the other hooks decided
]
