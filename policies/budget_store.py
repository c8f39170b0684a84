"""Where budgets are counted: the small interface both the in-process and the shared store implement.

The in-process `Budgets` (policies/budgets.py) is the embedded default and stays synchronous;
`LocalStore` puts it behind the same async interface as `RedisBudgets` (policies/redis_budgets.py),
so `SharedBudgets` (policies/shared_budgets.py) can fall back from one to the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from policies.budgets import Budgets
from policies.errors import LimitExceeded


@dataclass(frozen=True, slots=True)
class Tally:
    """Counters a settlement adds in its own round trip (the fleet usage of telemetry/fleet_usage.py).

    `fields` are added to the hash `key` (HINCRBYFLOAT), which expires `ttl_s` after the write;
    `bucket` is added to the sorted set `index` (member and score), whose entries below `oldest`
    are dropped. Both keys must carry the tenant's hash tag, like the budget keys.
    """

    key: str
    index: str
    bucket: int
    oldest: int
    ttl_s: int
    fields: dict[str, float]


class BudgetStore(Protocol):
    """Admit with a reservation, charge streams, settle at the end; the same semantics as `Budgets`."""

    async def admit(self, key: str, tenant: str, app: str, tokens: int, reserve_usd: float) -> None:
        """Count the request and hold `reserve_usd`, or raise LimitExceeded / BudgetExceeded without counting."""
        ...

    async def charge(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> LimitExceeded | None:
        """Charge tokens a stream produced; the error to end it with when it is now over a limit."""
        ...

    async def settle(self, key: str, tenant: str, app: str, tokens: int, cost: float, tally: Tally | None = None) -> bool:
        """Replace what the request held and was charged so far by its final tokens and cost.

        With `tally`, also add it in the same round trip where the store can: True when it did.
        """
        ...

    async def close(self) -> None: ...


class LocalStore:
    """The in-process budgets behind the store interface (no await ever suspends)."""

    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets

    async def admit(self, key: str, tenant: str, app: str, tokens: int, reserve_usd: float) -> None:
        self.budgets.admit(key, tenant, app, tokens, reserve_usd)

    async def charge(self, key: str, tenant: str, app: str, tokens: int, cost: float) -> LimitExceeded | None:
        return self.budgets.stream_breach(key, tokens, cost)

    async def settle(self, key: str, tenant: str, app: str, tokens: int, cost: float, tally: Tally | None = None) -> bool:
        self.budgets.settle(key, tokens, cost)
        return False  # nowhere to add a tally

    async def close(self) -> None:
        return None
